"""Per-token speed of one loaded model generating from the main thread, then a worker thread, then the main
thread again: what ``kernels.kernel_thread`` keeps equal.

    python examples/kernel_threads.py MODEL.gguf [--tokens 64] [--rounds 3] [--callers-own-threads]
    NUMBA_THREADING_LAYER=workqueue python examples/kernel_threads.py MODEL.gguf --callers-own-threads
    OMP_WAIT_POLICY=passive python examples/kernel_threads.py MODEL.gguf

``--callers-own-threads`` computes on each calling thread instead of the kernel thread (as before it), which
shows what a second Python thread does to numba's threading layer. Prints, per phase, the median generation
rate of ``--rounds`` generations, and the process's OS threads after it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading

import numba

from powerinfer_tools.runtime.engine import RuntimeModel
from powerinfer_tools.runtime.llm import LLM


def rate(llm: LLM, tokens: int) -> float:
    for _ in llm.generate("The history of the city", max_tokens=tokens):
        pass
    return llm.last_stats.generation_rate


def phase(llm: LLM, tokens: int, rounds: int) -> tuple[float, int]:
    rates = [rate(llm, tokens) for _ in range(rounds)]
    return statistics.median(rates), len(os.listdir("/proc/self/task"))


def on_worker(fn):
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", default="auto")
    parser.add_argument("--callers-own-threads", action="store_true")
    args = parser.parse_args()
    if args.callers_own_threads:
        RuntimeModel.forward = RuntimeModel.forward.__wrapped__
    llm = LLM.load(args.model, mode=args.mode)
    rate(llm, 4)  # first calls
    print(f"{args.model}: {llm.description}")
    print(f"threading layer {numba.config.THREADING_LAYER} ({numba.threading_layer()}), OMP_WAIT_POLICY "
          f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}, {'callers own threads' if args.callers_own_threads else 'kernel thread'}")
    for name, run in (("main thread", lambda: phase(llm, args.tokens, args.rounds)),
                      ("worker thread", lambda: on_worker(lambda: phase(llm, args.tokens, args.rounds))),
                      ("main thread again", lambda: phase(llm, args.tokens, args.rounds))):
        tok_s, threads = run()
        print(f"  {name:18s} {tok_s:7.1f} tok/s  ({threads} OS threads)")


if __name__ == "__main__":
    main()
