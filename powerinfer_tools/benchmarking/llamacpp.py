"""Loading a GGUF file with llama.cpp (through llama-cpp-python): the dense baseline of ``pitools
bench`` and the tests' independent oracle.

llama.cpp's CPU backend stores weights in an "extra" buffer type when one takes them, trying them in
order before the plain CPU buffer: AMX (Intel CPUs with AMX tiles) repacks for the tile
instructions, CPU_REPACK interleaves q4_0 (and q4_K, iq4_nl) rows for its AVX2/AVX-512/NEON GEMV
kernels (faster decoding than the plain layout on TinyLlama's shape in q4_0). Three ways to load:

- ``Buffers.PLAIN``: no extra buffer types (``use_extra_bufts = False``): ggml's plain ``vec_dot``
  kernels, the ones our runtime calls too. The tests' oracle.
- ``Buffers.REPACK``: llama.cpp's defaults without AMX: the AMX buffer type is taken out of the list
  the CPU device hands to llama.cpp (through ggml's backend registry) for the duration of the load.
  On some machines the CPU reports AMX and the kernel grants the tile permission
  (``arch_prctl``), so ggml picks AMX, but the hypervisor does not allow the tile instructions:
  the first matrix product dies with SIGILL at ``tileloadd``. ggml has no switch for that;
  ``tensor_buft_overrides`` cannot do it either (a tensor sent to CPU_REPACK is not checked against
  what that buffer can repack, and one sent to the CPU buffer is placed among the extra types again,
  AMX first), so the list is edited instead.
- ``Buffers.DEFAULT``: llama.cpp's defaults, AMX included where the CPU and the build have it.

``probe_amx`` tells, in a throwaway process, whether the AMX path works on this machine.
"""

from __future__ import annotations

import ctypes
import enum
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from powerinfer_tools.errors import PitoolsError

AMX = "AMX"  # ggml's name for its AMX buffer type


class Buffers(enum.Enum):
    PLAIN = "plain"
    REPACK = "repack"
    DEFAULT = "default"


class AmxStatus(enum.Enum):
    ON = "on"  # offered, and the probe ran through it
    ABSENT = "off: not offered (no AMX in this CPU or this build)"
    FAULTS = "off: llama.cpp's AMX path faults on this machine"


def load_llama_cpp(path: str | Path, buffers: Buffers = Buffers.PLAIN, **kwargs):
    """llama-cpp-python's ``Llama`` on ``path`` with the weight buffers ``buffers`` says (see the module
    docstring). ``kwargs`` go to ``Llama`` (``verbose`` defaults to False)."""
    import llama_cpp.llama as llama_module

    kwargs.setdefault("verbose", False)
    if buffers is Buffers.PLAIN:
        with _no_extra_buffers(llama_module):
            return llama_module.Llama(str(path), **kwargs)
    if buffers is Buffers.REPACK:
        with _extra_buffer_types_without(AMX):
            return llama_module.Llama(str(path), **kwargs)
    return llama_module.Llama(str(path), **kwargs)


@contextmanager
def _no_extra_buffers(llama_module):
    defaults = llama_module.llama_cpp.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = False
        return p

    llama_module.llama_cpp.llama_model_default_params = params
    try:
        yield
    finally:
        llama_module.llama_cpp.llama_model_default_params = defaults


def _extra_buffer_list():
    """The NULL-terminated array of extra buffer types that the CPU device gives llama.cpp at each
    model load (``ggml_backend_dev_get_extra_bufts``), and ggml's library to name them with."""
    import llama_cpp
    from llama_cpp._ggml import libggml as ggml

    pointer = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.restype, ggml.ggml_backend_dev_by_type.argtypes = pointer, [ctypes.c_int]
    ggml.ggml_backend_dev_backend_reg.restype, ggml.ggml_backend_dev_backend_reg.argtypes = pointer, [pointer]
    ggml.ggml_backend_reg_get_proc_address.restype = pointer
    ggml.ggml_backend_reg_get_proc_address.argtypes = [pointer, ctypes.c_char_p]
    ggml.ggml_backend_buft_name.restype, ggml.ggml_backend_buft_name.argtypes = ctypes.c_char_p, [pointer]
    llama_cpp.llama_backend_init()
    cpu = ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    address = cpu and ggml.ggml_backend_reg_get_proc_address(ggml.ggml_backend_dev_backend_reg(cpu),
                                                             b"ggml_backend_dev_get_extra_bufts")
    if not address:
        raise PitoolsError(f"llama-cpp-python {llama_cpp.__version__}: ggml's CPU device has no extra buffer types")
    get_extra_bufts = ctypes.CFUNCTYPE(ctypes.POINTER(pointer), pointer)(address)
    return get_extra_bufts(cpu), ggml


def extra_buffer_types() -> list[str]:
    """Names of the extra buffer types llama.cpp is offered for weights here, in order of preference."""
    array, ggml = _extra_buffer_list()
    return [ggml.ggml_backend_buft_name(array[i]).decode() for i in range(_length(array))]


def _length(array) -> int:
    count = 0
    while array[count]:
        count += 1
    return count


@contextmanager
def _extra_buffer_types_without(name: str):
    """Take the buffer type ``name`` out of the CPU device's extra buffer types; put it back after."""
    array, ggml = _extra_buffer_list()
    original = [array[i] for i in range(_length(array))]
    kept = [b for b in original if ggml.ggml_backend_buft_name(b).decode() != name]
    for i, buft in enumerate(kept + [None] * (len(original) - len(kept))):
        array[i] = buft
    try:
        yield
    finally:
        for i, buft in enumerate(original):
            array[i] = buft


def probe_amx(path: Path, threads: int) -> tuple[AmxStatus, list[str], str]:
    """Whether llama.cpp's AMX path works here: load ``path`` at llama.cpp's defaults in a throwaway
    process and evaluate a few tokens. Returns the status, the extra buffer types offered, and for a
    fault how the process died."""
    done = subprocess.run([sys.executable, "-m", __spec__.name, str(path), str(threads)], check=False,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    lines = done.stdout.strip().splitlines()
    offered = lines[0].split(",") if lines and lines[0] else []
    if done.returncode < 0:
        return AmxStatus.FAULTS, offered, f"the probe died with {signal.Signals(-done.returncode).name}"
    if done.returncode or len(lines) != 2 or lines[1] not in (AmxStatus.ON.name, AmxStatus.ABSENT.name):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise PitoolsError(f"{path}: llama.cpp's probe failed (exit status {done.returncode}): {tail}")
    return AmxStatus[lines[1]], offered, ""


def _probe_main(path: str, threads: int) -> None:
    """The probe process: print the extra buffer types offered, then ABSENT, or load at the defaults,
    run, and print ON (if it survives)."""
    offered = extra_buffer_types()
    print(",".join(offered), flush=True)  # before a fault can lose it
    if AMX not in offered:
        print(AmxStatus.ABSENT.name)
        return
    llm = load_llama_cpp(path, Buffers.DEFAULT, n_ctx=64, n_threads=threads, n_threads_batch=threads)
    llm.eval(list(range(8)))  # a prompt block (matrix-matrix products), then a decoding step
    llm.eval([8])
    print(AmxStatus.ON.name)


if __name__ == "__main__":
    _probe_main(sys.argv[1], int(sys.argv[2]))
