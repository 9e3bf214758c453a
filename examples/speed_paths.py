"""The engine's decoding speed through each way users reach it, side by side, and llama-cpp-python's.

Each round runs, in turn: `pitools run` (a process of its own, as a user runs it: its summary line's generation
rate), the Python API on the main thread and on a worker thread (``LLM.generate``'s ``last_stats``, in this script's
process), `pitools serve` (one non-streamed completion, then ``/metrics``'
``pitools_generation_tokens_per_second``), `pitools bench --baseline none` (its generation figure), and
llama-cpp-python at its defaults (``Llama(path)`` in a process of its own, its own thread count) on
``--llama-model`` (a PowerInfer file's dense twin) or MODEL. Every way decodes ``--tokens`` tokens after the same
short prompt, sampled alike (bench: as many tokens of its own text, then the text's next tokens). It prints each
way's median tokens/s over the rounds, its ratio to the median of ours, and to llama-cpp-python's; ``--json`` writes
them with every round's figures.

    python examples/speed_paths.py MODEL.powerinfer.gguf --llama-model MODEL.gguf [--tokens 64] [--rounds 3]

Run it on a quiet machine: the ways are timed one after another, not at once.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from powerinfer_tools.runtime.generation import SamplingConfig

from serve_side_by_side import free_port, server  # a sibling example's: the server, up while in use

PROMPT = "The river town grew slowly through the nineteenth century, as merchants built warehouses along the docks"
# Sampled, not greedy: a synthetic model's greedy text repeats two tokens, whose rows then stay in the caches (a
# token costs less than one of text); each way draws the same tokens from the same seed.
TEMPERATURE, SEED = 0.8, 0


def pitools(*args: str) -> list[str]:
    return [sys.executable, "-c", "from powerinfer_tools.commands.cli import main; main()", *args]


def through_run(args) -> float:
    command = pitools("run", str(args.model), "-p", PROMPT, "-n", str(args.tokens), "--temp", str(TEMPERATURE),
                      "--seed", str(SEED), "--threads", str(args.threads), "--mode", args.mode)
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    found = re.search(r"generation: \d+ tokens at ([\d.]+) tok/s", done.stderr + done.stdout)
    if found is None:
        raise SystemExit(f"pitools run printed no generation rate:\n{done.stderr}")
    return float(found.group(1))


def api_rate(llm, tokens: int) -> float:
    for _ in llm.generate(PROMPT, max_tokens=tokens, sampling=SamplingConfig(temperature=TEMPERATURE, seed=SEED)):
        pass
    return llm.last_stats.generation_rate


def through_worker(llm, tokens: int) -> float:
    rate = []
    worker = threading.Thread(target=lambda: rate.append(api_rate(llm, tokens)))
    worker.start()
    worker.join()
    return rate[0]


def through_serve(args) -> float:
    port = free_port()
    command = pitools("serve", str(args.model), "--port", str(port), "--threads", str(args.threads), "--mode",
                      args.mode)
    url = f"http://127.0.0.1:{port}"
    with server(command, port):
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        request = {"model": model, "prompt": PROMPT, "max_tokens": args.tokens, "temperature": TEMPERATURE,
                   "seed": SEED}
        httpx.post(f"{url}/v1/completions", json=request, timeout=600).raise_for_status()
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    return float(re.search(r"^pitools_generation_tokens_per_second ([\d.e+-]+)$", metrics, re.M).group(1))


def through_bench(args) -> float:
    command = pitools("bench", str(args.model), "--baseline", "none", "-n", str(args.tokens), "-p",
                      str(args.prompt_tokens), "--threads", str(args.threads), "--mode", args.mode, "--json", "--quiet")
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)["engines"][args.mode]["generation_tokens_per_s"]


# llama-cpp-python in a process of its own, as its users run it (in ours, its ggml threads and ours would share the
# cores and OpenMP's state): llama.cpp's own decoding rate of a completion (its perf counters)
LLAMA_CPP = """
import sys, llama_cpp
llama = llama_cpp.Llama(sys.argv[1], verbose=False)
llama(sys.argv[2], max_tokens=int(sys.argv[3]), temperature=float(sys.argv[4]), seed=int(sys.argv[5]))
data = llama_cpp.llama_perf_context(llama.ctx)
print(data.n_eval / (data.t_eval_ms / 1e3))
"""


def through_llama_cpp(args) -> float:
    command = [sys.executable, "-c", LLAMA_CPP, str(args.llama_model or args.model), PROMPT, str(args.tokens),
               str(TEMPERATURE), str(SEED)]
    return float(subprocess.run(command, capture_output=True, text=True, check=True).stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--llama-model", type=Path, default=None, help="What llama-cpp-python runs [default: MODEL].")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mode", choices=("sparse", "dense"), default="sparse", help="Our FFN mode (bench's).")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from powerinfer_tools import kernels
    from powerinfer_tools.runtime.llm import LLM

    kernels.set_threads(args.threads)
    llm = LLM.load(args.model, mode=args.mode)
    ways = {"run": lambda: through_run(args), "API, main thread": lambda: api_rate(llm, args.tokens),
            "API, worker thread": lambda: through_worker(llm, args.tokens), "serve": lambda: through_serve(args),
            "bench": lambda: through_bench(args), "llama-cpp-python": lambda: through_llama_cpp(args)}
    api_rate(llm, 8)  # the process's first calls, as the other ways pay theirs before the tokens they time
    args.prompt_tokens = llm.last_stats.prompt_tokens  # bench's prompt: as long as the others
    rates: dict[str, list[float]] = {way: [] for way in ways}
    for round_ in range(args.rounds):
        for way, measure in ways.items():
            rates[way].append(measure())
            print(f"round {round_ + 1} {way:>20}: {rates[way][-1]:6.1f} tok/s", flush=True)
    medians = {way: statistics.median(r) for way, r in rates.items()}
    ours = statistics.median(medians[way] for way in ways if way != "llama-cpp-python")
    print(f"\nmedians over {args.rounds} rounds, {args.tokens} tokens "
          "(ratio to the median of ours; to llama-cpp-python):")
    for way, rate in medians.items():
        print(f"  {way:>20}: {rate:6.1f} tok/s  {rate / ours:5.2f}  {rate / medians['llama-cpp-python']:5.2f}x")
    if args.json is not None:
        report = {"settings": {k: str(v) for k, v in vars(args).items()}, "rounds": rates, "medians": medians}
        args.json.write_text(json.dumps(report, indent=2))

if __name__ == "__main__":
    main()
