"""A prompt's time (or a decoded token's) on two checkouts of this package, alternating: what a change to the
prompt (or decode) path is worth.

Each round runs one process per checkout (``--before``, then this one), each loading MODEL and timing
``--repeats`` prompts of ``--tokens`` token ids in process after two warm-up prompts (``RuntimeModel.forward``,
the last token's logits only, as generation asks); the machine's drift between rounds falls on both alike.
Prints each round's medians (with the page faults a prompt took: fresh memory the kernel zeroed, see
docs/lab/kernels.md, "Page faults in prompts"; and each process's peak RSS) and the median of the per-round ratios.
With ``--decode N``, what is timed is instead a decoded token: N one-token steps after the prompt, each feeding
the likeliest token to the next (the time per step, the mean over the N).

    git worktree add /tmp/before <commit>
    python examples/prompt_ab.py MODEL.gguf --before /tmp/before [--rounds 3] [--mode sparse] [--decode 32] [--json R]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent  # this checkout


def time_prompts(model: str, mode: str, tokens: int, repeats: int, decode: int) -> tuple[float, float, float]:
    """Median seconds of a ``tokens``-token prompt in this process (with ``decode``, of a decoded token after
    it), the minor page faults of one, and the process's peak RSS in MiB."""
    import numpy as np

    from powerinfer_tools.runtime.llm import LLM

    engine = LLM.load(model, mode=mode).engine
    ids = np.random.default_rng(0).integers(100, 20000, tokens)

    def once() -> float:
        caches = engine.new_cache()
        start = time.perf_counter()
        logits = engine.forward(ids, caches, all_logits=False)
        if not decode:
            return time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(decode):
            logits = engine.forward(np.array([int(np.argmax(logits[-1]))]), caches, all_logits=False)
        return (time.perf_counter() - start) / decode

    once(), once()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    median = statistics.median(once() for _ in range(repeats))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return median, (usage.ru_minflt - faults) / repeats, usage.ru_maxrss / 1024


def in_checkout(checkout: Path, args) -> tuple[float, float, float]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    command = [sys.executable, __file__, args.model, "--child", "--mode", args.mode, "--tokens", str(args.tokens),
               "--repeats", str(args.repeats), "--decode", str(args.decode)]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    seconds, faults, rss = out.split()[-3:]
    return float(seconds), float(faults), float(rss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--before", type=Path, help="the other checkout (a folder holding powerinfer_tools/)")
    parser.add_argument("--mode", default="sparse", help="the FFN mode, as LLM.load takes it (default: sparse)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=9, help="prompts timed per process (median)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode", type=int, default=0, help="time N decoded tokens after the prompt instead")
    parser.add_argument("--json", type=Path, help="also write the rounds and the median ratio to this JSON file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(*time_prompts(args.model, args.mode, args.tokens, args.repeats, args.decode))
        return
    if args.before is None:
        parser.error("--before is required")
    ratios, rounds = [], []
    for i in range(args.rounds):
        (before, before_faults, before_rss), (after, after_faults, after_rss) = (in_checkout(args.before, args),
                                                                                 in_checkout(HERE, args))
        ratios.append(before / after)
        rounds.append({"before_s": before, "after_s": after, "before_peak_rss_mib": before_rss,
                       "after_peak_rss_mib": after_rss})
        print(f"round {i + 1}: before {1000 * before:.1f} ms ({before_faults:,.0f} page faults, peak RSS "
              f"{before_rss:.0f} MiB), this checkout {1000 * after:.1f} ms ({after_faults:,.0f}, {after_rss:.0f} MiB) "
              f"({before / after:.2f}x)", flush=True)
    timed = f"a token decoded after a {args.tokens}-token prompt" if args.decode else f"{args.tokens}-token prompt"
    print(f"{timed}, this checkout against --before: {statistics.median(ratios):.2f}x "
          f"(median of {args.rounds} rounds)")
    if args.json is not None:
        from powerinfer_tools.benchmarking.machine import cpu_description

        report = {"model": args.model, "mode": args.mode, "timed": timed, "tokens": args.tokens, "decode": args.decode,
                  "repeats": args.repeats, "rounds": rounds, "median_ratio": statistics.median(ratios),
                  "before": str(args.before), "cpu": cpu_description()}
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
