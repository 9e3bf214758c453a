"""For the server's tests: `pitools serve` started, the real command in its own process on a free port, or an
app served in this process as it serves one (``running``), on the bundled model slowed so that a generation lasts
as long as a test needs (``slowed``); requests streamed or sent in the background, and the server's metrics."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from powerinfer_tools.runtime.llm import LLM
from powerinfer_tools.serving.uvicorn_server import http_server

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


STEP_SECONDS = 0.025
LONG = {"model": "tiny", "prompt": "import os\n", "max_tokens": 240, "temperature": 0}  # >= 6 s on the model
SHORT = {"model": "tiny", "prompt": "def ", "max_tokens": 3, "temperature": 0}


def slowed(llm: LLM) -> LLM:
    """``llm`` with every forward pass (a prompt's, a step of one or more generations) slowed by ``STEP_SECONDS``
    and its end-of-sequence token never chosen."""
    engine, eos = llm.engine, llm.engine.spec.eos_token_id
    forward, forward_batch = engine.forward, engine.forward_batch

    def slow(compute):
        def slowed_pass(*args, **kwargs):
            time.sleep(STEP_SECONDS)
            logits = np.array(compute(*args, **kwargs))
            logits[..., eos] = -np.inf
            return logits

        return slowed_pass

    engine.forward, engine.forward_batch = slow(forward), slow(forward_batch)
    return llm


@contextlib.contextmanager
def running(app):
    """``app`` served as ``pitools serve`` serves it, on a free port; yields the base URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    server = http_server(app, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    until(lambda: server.started, seconds=30)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def until(condition, seconds: float = 10.0) -> float:
    """Waits for ``condition()``; returns how long it took."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < seconds, "timed out"
        time.sleep(0.02)
    return time.monotonic() - start


@contextlib.contextmanager
def streaming(url: str, body: dict, started: bool = True):
    """A streamed request, open until the block ends (then its connection closes, as a client that goes
    away); with ``started``, once its first text has arrived."""
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/completions",
                                                           json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # held: a dropped line iterator would close the connection
        if started:
            next(line for line in lines if line.startswith("data: {"))
        yield lines


def in_background(request) -> dict:
    """``request()`` on a thread of its own: the dict returned holds the thread, then its ``response``."""
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(response=request()), daemon=True)
    thread.start()
    result["thread"] = thread
    return result
