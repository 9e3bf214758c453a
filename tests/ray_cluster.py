"""A Ray cluster of two nodes of one CPU each on this machine, for tests/test_ray.py and
examples/ray_scale_out.py: a temp folder and ports of its own, so that it collides with no other
cluster on the machine, and stopped by the session ids of its processes (``ray stop`` would stop
every Ray process of the machine, other people's too)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def two_nodes(env: dict[str, str]) -> Iterator[str]:
    """Start a head and a second node, their processes with ``env`` added; yield the head's address.

    Without token authentication: Ray 2.60 turns it on for a new head when it finds ~/.ray/auth_token
    (a ``ray.init()`` of its own writes one), yet not for a node joining it. RAY_AUTH_MODE set in this
    process as well makes nodes and drivers (this process and the commands it starts) agree whatever
    the home folder holds."""
    temp = Path(tempfile.mkdtemp(prefix="pitools-ray-", dir="/tmp"))  # short: Ray's socket paths have a limit
    saved_auth_mode = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    node_env = {**os.environ, **env, "RAY_USAGE_STATS_ENABLED": "0"}
    port = _free_port()
    address, sessions = f"127.0.0.1:{port}", set()
    try:
        # The head serves Ray Client, on port 10001 unless told another, where its dependency (grpc) is
        # installed, and refuses a port where it is not (the minimal `pip install ray`).
        client = [f"--ray-client-server-port={_free_port()}"] if importlib.util.find_spec("grpc") else []
        sessions.add(_ray_start(node_env, "--head", f"--port={port}", f"--temp-dir={temp}",
                                "--include-dashboard=false", *client))
        sessions.add(_ray_start(node_env, f"--address={address}"))
        yield address
    finally:
        _stop_sessions(sessions)
        shutil.rmtree(temp, ignore_errors=True)
        if saved_auth_mode is None:
            del os.environ["RAY_AUTH_MODE"]
        else:
            os.environ["RAY_AUTH_MODE"] = saved_auth_mode


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_start(env: dict, *args: str) -> int:
    """Start one node, with every port of its own (so that it collides neither with the other node nor
    with another cluster), in a new session; return the session id its processes share."""
    ports = ("--node-manager-port", "--object-manager-port", "--metrics-export-port", "--runtime-env-agent-port",
             "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port")
    command = [str(Path(sys.executable).with_name("ray")), "start", "--num-cpus=1", "--disable-usage-stats",
               "--node-ip-address=127.0.0.1", *(f"{port}={_free_port()}" for port in ports), *args]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    return process.pid


def _session(stat: Path) -> int:
    return int(stat.read_text().rsplit(")", 1)[1].split()[3])  # pid (comm) state ppid pgrp session ...


def _stop_sessions(sessions: set[int]) -> None:
    """SIGTERM (then SIGKILL) to every process of these sessions: this cluster's, no other."""
    def ours() -> list[int]:
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if _session(stat) in sessions:
                    pids.append(int(stat.parent.name))
            except (OSError, ValueError, IndexError):
                pass  # ended meanwhile
        return pids

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in ours():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while ours() and time.monotonic() < deadline:
            time.sleep(0.2)
