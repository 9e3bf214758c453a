"""`pitools serve` against llama.cpp's server under the same closed-loop load: what users of each get.

    python examples/serve_side_by_side.py MODEL.gguf --llama-server /path/to/llama-server --rounds 3 --out r.json
    python examples/serve_side_by_side.py MODEL.gguf                  # llama-cpp-python's server instead
    python examples/serve_side_by_side.py M.powerinfer.gguf --llama-model M.gguf --llama-server ...   # a sparse file

Each round starts every server alone on 127.0.0.1 (ours, then llama.cpp's; the order alternates between rounds),
runs every workload against it with ``examples/serve_load_test.py`` (non-streamed /v1/completions, N clients each
sending its next request as soon as its last is answered, prompts of W words of held-out text, T tokens out,
temperature 0.7, each request its own seed) and stops it. Workloads (``--workloads``) are CLIENTS:REQUESTS:WORDS:
TOKENS; the default is the issue's three: one client, eight clients, sixteen clients with 200-word prompts. Prints
per workload and server the medians over rounds of requests/s, completion tokens/s and latency p50/p99, and writes
every round's report with them (``--out``, JSON).

llama.cpp's server is the native ``llama-server`` given by ``--llama-server`` (``-np`` slots, continuous batching
as it does by default), else llama-cpp-python's (``examples/llama_cpp_server.py``: one request at a time).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

EXAMPLES = Path(__file__).resolve().parent
DEFAULT_WORKLOADS = ["1:8:20:64", "8:32:20:64", "16:32:200:32"]
STARTUP_SECONDS = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commands(args, port: int) -> dict[str, list[str]]:
    """How each server is started on ``port``, serving the model as ``args.model_id``."""
    ours = [sys.executable, "-c", "from powerinfer_tools.commands.cli import main; main()", "serve", str(args.model),
            "--host", "127.0.0.1",
            "--port", str(port), "-t", str(args.threads), "--model-name", args.model_id, "--max-queue", "256",
            *(["--parallel", str(args.parallel)] if args.parallel else []), *args.ours_option]
    theirs = str(args.llama_model or args.model)
    if args.llama_server:
        llama = [args.llama_server, "-m", theirs, "--host", "127.0.0.1", "--port", str(port),
                 "-t", str(args.threads), "-np", str(args.llama_parallel), "-c", str(args.llama_context),
                 "--alias", args.model_id]
    else:
        llama = [sys.executable, str(EXAMPLES / "llama_cpp_server.py"), "--model", theirs, "--host",
                 "127.0.0.1", "--port", str(port), "--n_threads", str(args.threads), "--model_alias", args.model_id,
                 "--interrupt_requests", "False"]
    return {"ours": ours, "llama.cpp": llama}


@contextlib.contextmanager
def server(command: list[str], port: int, log: Path = Path(os.devnull)):
    """The server ``command`` starts, once it answers ``/health`` on ``port`` (its output in ``log``); stopped
    after."""
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if process.poll() is not None:
                raise SystemExit(f"{command[0]} exited ({process.returncode}): see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"{command[0]} did not start in {STARTUP_SECONDS} s: see {log}")
            time.sleep(0.5)
        yield
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def load(port: int, workload: str, args, out: Path) -> dict:
    clients, requests, words, tokens = workload.split(":")
    subprocess.run([sys.executable, str(EXAMPLES / "serve_load_test.py"), "--url", f"http://127.0.0.1:{port}",
                    "--model", args.model_id, "--clients", clients, "--requests", requests, "--words", words,
                    "--max-tokens", tokens, "--temperature", "0.7", "--stream-share", "0", "--chat-share", "0",
                    "--out", str(out)], stdout=subprocess.DEVNULL, check=False)
    report = json.loads(out.read_text())
    return {"requests_per_second": report["requests_per_second"],
            "tokens_per_second": report["completion_tokens_per_second"],
            "p50": report["latency_seconds"]["p50"], "p99": report["latency_seconds"]["p99"],
            "failed": report["failed"], "report": report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--llama-server", default=None, help="llama.cpp's native llama-server binary.")
    parser.add_argument("--llama-model", type=Path, default=None,
                        help="The file llama.cpp serves, where it is not MODEL: a PowerInfer file's dense twin.")
    parser.add_argument("--llama-parallel", type=int, default=4, help="Its slots (-np).")
    parser.add_argument("--llama-context", type=int, default=8192, help="Its context (-c), shared by its slots.")
    parser.add_argument("--parallel", type=int, default=None, help="Our --parallel [default: pitools serve's].")
    parser.add_argument("--ours-option", action="append", default=[], help="A further option of pitools serve.")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--workloads", nargs="+", default=DEFAULT_WORKLOADS, metavar="CLIENTS:REQUESTS:WORDS:TOKENS")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model-id", default="model")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results: dict = {w: {"ours": [], "llama.cpp": []} for w in args.workloads}
    folder = Path(tempfile.mkdtemp(prefix="serve-side-by-side-"))
    for round_ in range(args.rounds):
        names = ["ours", "llama.cpp"] if round_ % 2 == 0 else ["llama.cpp", "ours"]
        for name in names:
            port = free_port()
            with server(commands(args, port)[name], port, folder / f"{name}-{round_}.log"):
                for w in args.workloads:
                    result = load(port, w, args, folder / f"{name}-{round_}-{w.replace(':', '-')}.json")
                    results[w][name].append(result)
                    print(f"round {round_ + 1} {name:9s} {w:14s} {result['requests_per_second']:6.2f} req/s "
                          f"{result['tokens_per_second']:7.1f} tok/s p50 {result['p50']:.2f} s p99 {result['p99']:.2f} s "
                          f"failed {result['failed']}", flush=True)
    summary = {w: {name: {key: statistics.median(r[key] for r in rounds)
                          for key in ("requests_per_second", "tokens_per_second", "p50", "p99")}
                   for name, rounds in by_server.items()} for w, by_server in results.items()}
    print("\nmedians over rounds (ours / llama.cpp):")
    for w, by_server in summary.items():
        ours, llama = by_server["ours"], by_server["llama.cpp"]
        print(f"  {w:14s} req/s {ours['requests_per_second']:.2f} / {llama['requests_per_second']:.2f} "
              f"({ours['requests_per_second'] / llama['requests_per_second']:.2f}x), tok/s {ours['tokens_per_second']:.1f}"
              f" / {llama['tokens_per_second']:.1f}, p50 {ours['p50']:.2f} / {llama['p50']:.2f} s, "
              f"p99 {ours['p99']:.2f} / {llama['p99']:.2f} s")
    if args.out:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.out.write_text(json.dumps({"settings": settings, "summary": summary, "rounds": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
