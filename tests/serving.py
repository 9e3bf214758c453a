"""Starting `pitools serve` for the server's tests: the real command in its own process, on a free port."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

STARTUP_SECONDS = 180  # loading a model and compiling the kernels, on a busy 2-core machine


@contextlib.contextmanager
def serving(model: Path, log: Path, *options: str, env: dict | None = None):
    """``pitools serve MODEL --port 0 OPTIONS`` running; yields its base URL (``http://127.0.0.1:PORT``)."""
    with serving_process(model, log, *options, env=env) as (_, url):
        yield url


@contextlib.contextmanager
def serving_process(model: Path, log: Path, *options: str, env: dict | None = None, prelude: str = ""):
    """As ``serving``, yielding the process too (to signal it), with ``prelude`` (Python lines ending in a
    newline: a test's changes to the model, say) run in it before the command."""
    command = [sys.executable, "-c", prelude + "from powerinfer_tools.commands.cli import main; main()",
               "serve", str(model), "--port", "0", *options]
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr,
                                   env={**os.environ, **(env or {})})
    try:
        yield process, _wait_until_up(process, log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_until_up(process: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + STARTUP_SECONDS
    url = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"pitools serve exited ({process.returncode}):\n{log.read_text()}")
        found = re.search(r" at (http://127\.0\.0\.1:\d+)/v1", log.read_text())
        url = url or (found and found.group(1))
        if url:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return url
        time.sleep(0.2)
    raise AssertionError(f"pitools serve did not start in {STARTUP_SECONDS} s:\n{log.read_text()}")


def metric(url: str, name: str, headers: dict | None = None) -> float:
    """One unlabelled value of the server's /metrics."""
    text = httpx.get(f"{url}/metrics", headers=headers or {}, timeout=10).text
    values = [line.split(" ")[1] for line in text.splitlines() if line.startswith(f"pitools_{name} ")]
    assert values, f"no pitools_{name} in /metrics:\n{text}"
    return float(values[0])
