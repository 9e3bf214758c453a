"""How long a user waits before the first token, and how much memory a run takes.

    python examples/startup_times.py MODEL.gguf [--repeats 3] [--serve] [--before CHECKOUT] [--json]

Each figure is a fresh ``pitools`` process, timed from its start:

* **cold first run**: ``pitools run MODEL -n 16`` with an empty numba cache (``NUMBA_CACHE_DIR`` set
  to a new folder), as ``pitools run`` does by default (``--kernels background``: it runs on the NumPy
  kernels while a background process compiles), and how long that background build took until its
  marker appeared; then the same with ``--kernels wait`` in another empty cache: what compiling
  before the first token costs;
* **warm start to first token**: the same command with the cache filled, from the process's start to
  the first byte of generated text on its stdout (after the echoed prompt) (the median of ``--repeats``), and the whole run;
* **serve, first request**: with ``--serve``, ``pitools serve MODEL --port 0`` started, then one
  streamed completion: time from the process's start to the first streamed token, and from the
  request to it;
* **peak RSS** of a warm run (the child's own ``wait4`` rusage), beside the model file's size;
* with ``--before CHECKOUT``: the warm start of another checkout of the package, in rounds alternating with
  this one's (what a change did to it, on a machine whose speed drifts).

The prompt is three words; ``-t`` threads as ``pitools run`` defaults. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import select
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PROMPT = "import os"
TOKENS = 16  # enough that the one-token decode path runs (and, on a cold run, compiles)


def _pitools(*args: str, env: dict | None = None) -> subprocess.Popen:
    code = "import sys; from powerinfer_tools.commands.cli import main; sys.argv[0] = 'pitools'; main()"
    # -P: the current folder is not put first on sys.path, where a checkout there would shadow PYTHONPATH's
    return subprocess.Popen([sys.executable, "-P", "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **(env or {})})


def _first_output(process: subprocess.Popen, started: float, skip: int = 0, timeout: float = 600) -> float:
    """Seconds from ``started`` until ``process`` writes to stdout its first byte after the ``skip`` first."""
    for _ in range(skip + 1):
        ready, _, _ = select.select([process.stdout], [], [], timeout)
        if not ready or not process.stdout.read(1):
            raise RuntimeError(f"no output: {process.communicate()[1].decode()[-2000:]}")
    return time.perf_counter() - started


def _failed_and_ended(marker: Path) -> bool:
    with open(marker.with_suffix(".lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # still building
        fcntl.flock(lock, fcntl.LOCK_UN)
    return marker.exists()


def background_build_s(cache: str, started: float, timeout: float = 900) -> float:
    """Seconds from ``started`` until the background build's marker appears in ``cache``."""
    while not list(Path(cache).glob("pitools-warm-*.done")):
        # the build writes its .failed marker when it starts and removes it when it succeeds: it failed only
        # if the marker is there once the build has let go of its lock
        failed = any(map(_failed_and_ended, Path(cache).glob("pitools-warm-*.failed")))
        if failed or time.perf_counter() - started > timeout:
            raise RuntimeError(f"the background build failed or did not end: see {cache}")
        time.sleep(0.2)
    return time.perf_counter() - started


def timed_run(model: Path, env: dict | None = None) -> dict:
    """One ``pitools run MODEL -n TOKENS``: seconds to the first token and to the end, and the process's peak RSS."""
    started = time.perf_counter()
    process = _pitools("run", str(model), "-p", PROMPT, "-n", str(TOKENS), env=env)
    first = _first_output(process, started, skip=len(PROMPT.encode()))  # run echoes the prompt first
    process.stdout.read()
    stderr = process.stderr.read().decode()  # a few lines: no pipe fills while stdout is read
    _, status, usage = os.wait4(process.pid, 0)  # this child's own rusage, not every child's maximum
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise RuntimeError(stderr[-2000:])
    return {"first_token_s": first, "total_s": time.perf_counter() - started, "peak_rss_mib": usage.ru_maxrss / 1024}


def serve_first_request(model: Path, cache: str) -> dict:
    """Start ``pitools serve``, stream one completion: seconds from the process's start and from the request
    to the first streamed token."""
    started = time.perf_counter()
    process = _pitools("serve", str(model), "--port", "0", env={"NUMBA_CACHE_DIR": cache})
    try:
        url = None
        while url is None:
            line = process.stderr.readline().decode()
            if not line:
                raise RuntimeError("pitools serve ended before listening")
            found = re.search(r"at (http://\S+)/v1", line)
            url = found.group(1) if found else None
        listening = time.perf_counter() - started
        body = json.dumps({"model": model.name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                           "stream": True}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        asked = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as response:
            for raw in response:
                if raw.startswith(b"data: ") and b'"text": ""' not in raw and b"[DONE]" not in raw:
                    break
        now = time.perf_counter()
        return {"listening_s": listening, "first_token_from_start_s": now - started,
                "first_token_from_request_s": now - asked}
    finally:
        process.terminate()
        process.communicate(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve", action="store_true", help="also time pitools serve's first request")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--before", type=Path, metavar="CHECKOUT",
                        help="also time the warm start of another checkout of the package (its root folder, put on "
                             "PYTHONPATH), in rounds alternating with this one's, its kernels in a cache of its own")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="numba-cold-") as waited:
        cold_wait = timed_run(args.model, {"NUMBA_CACHE_DIR": waited, "PITOOLS_KERNELS": "wait"})
    with tempfile.TemporaryDirectory(prefix="numba-cold-") as cache, \
            tempfile.TemporaryDirectory(prefix="numba-before-") as before_cache:
        environment = {"NUMBA_CACHE_DIR": cache, "PITOOLS_KERNELS": "background"}
        started = time.perf_counter()
        cold = timed_run(args.model, environment)
        built = background_build_s(cache, started)
        engines = [([], environment)]
        if args.before:
            before_environment = {"NUMBA_CACHE_DIR": before_cache, "PITOOLS_KERNELS": "background",
                                  "PYTHONPATH": str(args.before.resolve())}
            timed_run(args.model, before_environment)  # its kernels built as this one's were
            background_build_s(before_cache, time.perf_counter())
            engines.append(([], before_environment))
        for round_ in range(args.repeats):  # the engines take turns, the first of a round alternating
            for runs, env in engines[:: 1 if round_ % 2 == 0 else -1]:
                runs.append(timed_run(args.model, env))
        warm = engines[0][0]
        serve = serve_first_request(args.model, cache) if args.serve else None  # (its kernels from the same cache)
    report = {
        "model": str(args.model), "model_mib": args.model.stat().st_size / 2**20,
        "cold_first_run_s": cold["total_s"], "cold_first_token_s": cold["first_token_s"],
        "background_build_s": built, "cold_first_run_waiting_s": cold_wait["total_s"],
        "warm_first_token_s": statistics.median(r["first_token_s"] for r in warm),
        "warm_total_s": statistics.median(r["total_s"] for r in warm),
        "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in warm),
        "serve": serve,
    }
    if args.before:
        before = engines[1][0]
        report["before"] = {"checkout": str(args.before),
                            "warm_first_token_s": statistics.median(r["first_token_s"] for r in before),
                            "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in before),
                            "warm_first_token_ratio": statistics.median(
                                now["first_token_s"] / then["first_token_s"] for now, then in zip(warm, before))}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{args.model.name} ({report['model_mib']:.1f} MiB)")
    print(f"  cold first run (empty kernel cache): {report['cold_first_run_s']:.2f} s "
          f"(first token {report['cold_first_token_s']:.2f} s; NumPy kernels while the background build "
          f"took {report['background_build_s']:.1f} s); waiting for the build: {report['cold_first_run_waiting_s']:.1f} s")
    print(f"  warm start to first token:           {report['warm_first_token_s']:.2f} s "
          f"(whole run {report['warm_total_s']:.2f} s; median of {args.repeats})")
    if serve:
        print(f"  serve, first streamed token:         {serve['first_token_from_start_s']:.2f} s from start, "
              f"{serve['first_token_from_request_s']:.2f} s from the request")
    print(f"  peak RSS:                            {report['peak_rss_mib']:.0f} MiB")
    if args.before:
        before = report["before"]
        print(f"  {args.before}, in alternate rounds: warm start to first token {before['warm_first_token_s']:.3f} s "
              f"(this one {report['warm_first_token_s']:.3f} s; per-round ratio's median "
              f"{before['warm_first_token_ratio']:.3f}x), peak RSS {before['peak_rss_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
