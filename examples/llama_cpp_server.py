"""llama.cpp's OpenAI-compatible server, as llama-cpp-python ships it: the baseline of the serving load test.

    pip install 'llama-cpp-python[server]==0.3.36'
    python examples/llama_cpp_server.py --model MODEL.gguf --port 8081 --n_threads 2

Arguments are llama-cpp-python's server's own (``python -m llama_cpp.server --help``), and its defaults
stand, but for one thing: on a machine where llama.cpp's AMX path faults (the CPU reports AMX tiles,
the hypervisor refuses them: SIGILL at the first product), the AMX buffer type is taken out before the
model loads, exactly as ``pitools bench`` does (``benchmarking/llamacpp.py``), so llama.cpp keeps its
other defaults, its q4_0 repacking included.
"""

from __future__ import annotations

import sys

import llama_cpp
from llama_cpp.server.__main__ import main

from powerinfer_tools.benchmarking.llamacpp import AmxStatus, Buffers, load_llama_cpp, probe_amx


def model_argument(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--model" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--model="):
            return arg.split("=", 1)[1]
    raise SystemExit("give --model MODEL.gguf")


if __name__ == "__main__":
    status, offered, how = probe_amx(model_argument(sys.argv[1:]), threads=2)
    buffers = Buffers.REPACK if status is AmxStatus.FAULTS else Buffers.DEFAULT
    print(f"llama.cpp's extra buffer types here: {offered}; AMX {status.value}{f' ({how})' if how else ''}; "
          f"loading with {buffers.value} buffers", file=sys.stderr)

    class LoadedWithOurBuffers(llama_cpp.llama.Llama):
        """The server builds its model with ``llama_cpp.Llama(model_path=..., ...)`` and calls the class's
        methods (``Llama.__call__``): a subclass whose construction goes through our loader keeps both."""

        def __new__(cls, model_path, **settings):
            return load_llama_cpp(model_path, buffers, **settings)

    llama_cpp.Llama = LoadedWithOurBuffers
    main()
