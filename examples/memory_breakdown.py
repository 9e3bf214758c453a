"""Where the runtime's resident memory goes: RSS by mapping after loading a model and generating.

    python examples/memory_breakdown.py MODEL.powerinfer.gguf [--tokens 64]

Loads MODEL on the sparse runtime (the Python API), generates ``--tokens`` greedy tokens from a short
prompt, then sums ``Rss`` from ``/proc/self/smaps`` (Linux only) by what is mapped: the model file's
pages, numba/llvmlite's libraries (LLVM is loaded even when every kernel comes from numba's cache),
llama-cpp-python's ggml, OpenBLAS, the other shared libraries, and anonymous memory and heap (KV
cache, scratch, Python objects). The total is the process's RSS at that moment, which is what
``pitools bench`` reports as peak RSS for our engine to within the prompt's transient buffers.
"""

from __future__ import annotations

import argparse
import collections
import re

from powerinfer_tools.runtime.llm import LLM

PROMPT = "Once upon a time there was a little fox who lived in the forest and"
KINDS = [  # (substring of the mapped path, label): the first that matches names the mapping
    (".gguf", "model file"),
    ("llvmlite", "numba/llvmlite libraries"),
    ("numba", "numba/llvmlite libraries"),
    ("llama_cpp", "llama-cpp-python's ggml"),
    ("openblas", "OpenBLAS"),
    (".so", "other shared libraries"),
]


def mapping_kind(path: str) -> str:
    if not path.startswith("/"):
        return "anonymous and heap" if path in ("", "[heap]") else path
    return next((label for key, label in KINDS if key in path), "other files")


def resident_by_kind() -> collections.Counter:
    sizes: collections.Counter = collections.Counter()
    kind = ""
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                fields = line.split()
                kind = mapping_kind(fields[5] if len(fields) > 5 else "")
            elif line.startswith("Rss:"):
                sizes[kind] += int(line.split()[1]) * 1024
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    llm = LLM.load(args.model, mode="sparse")
    for _ in llm.generate(PROMPT, max_tokens=args.tokens):
        pass
    sizes = resident_by_kind()
    for kind, size in sizes.most_common():
        if size >= 1 << 20:
            print(f"{size / 2**20:8.1f} MiB  {kind}")
    print(f"{sum(sizes.values()) / 2**20:8.1f} MiB  total")


if __name__ == "__main__":
    main()
