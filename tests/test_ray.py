"""``--ray ADDRESS``: predictor training on a real two-node Ray cluster started on this machine writes
exactly what training in one process writes, survives a worker killed mid-task, and ends with one error
line when a layer fails on every attempt; without Ray, ``--ray`` says how to install it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from cli_checks import fails, invoke, snapshot
from tiny_models import run_profiler

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.cluster.ray_training import CRASHES_VARIABLE, INSTALL_HINT, ONE_THREAD
from powerinfer_tools.models import load_model

# Quick training settings of train-predictors (the tiny model's two layers train in seconds).
QUICK = ("--epochs", "2", "--budget", "0.3", "--recall", "0.9", "--min-precision", "0.2", "-q")


def test_without_ray_the_option_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    fails("train-predictors", tmp_path, "-o", tmp_path / "pred", "--ray", "127.0.0.1:1", match=INSTALL_HINT)
    assert not (tmp_path / "pred").exists()


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
               *(f"{port}={_free_port()}" for port in ports), *args]
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


@pytest.fixture(scope="module")
def cluster():
    """A head and a second node of one CPU each, in a temp folder of their own; yields (address, crash folder)."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    temp = Path(tempfile.mkdtemp(prefix="pitools-ray-", dir="/tmp"))  # short: Ray's socket paths have a limit
    crashes = temp / "crashes"
    crashes.mkdir()
    # Without a token: Ray 2.60 turns token authentication on for a new head when it finds ~/.ray/auth_token
    # (a `ray.init()` of its own writes one), yet not for a node joining it; set here, nodes and drivers
    # (this process, and the commands it starts) agree whatever the home folder holds.
    saved_auth_mode = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    env = {**os.environ, CRASHES_VARIABLE: str(crashes), "RAY_USAGE_STATS_ENABLED": "0"}
    port = _free_port()
    address, sessions = f"127.0.0.1:{port}", set()
    try:
        sessions.add(_ray_start(env, "--head", f"--port={port}", f"--temp-dir={temp}", "--include-dashboard=false",
                                f"--ray-client-server-port={_free_port()}", "--node-ip-address=127.0.0.1"))
        sessions.add(_ray_start(env, f"--address={address}", "--node-ip-address=127.0.0.1"))
        yield address, crashes
    finally:
        _stop_sessions(sessions)
        shutil.rmtree(temp, ignore_errors=True)
        if saved_auth_mode is None:
            del os.environ["RAY_AUTH_MODE"]
        else:
            os.environ["RAY_AUTH_MODE"] = saved_auth_mode


@pytest.fixture(scope="module")
def profile(sparse_tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ray-profile") / "prof"
    run_profiler(load_model(Checkpoint(sparse_tiny)), np.random.default_rng(0).integers(0, 256, 3000), folder)
    return folder


def pitools_on_one_thread(*args) -> None:
    """``pitools ARGS`` in a process of its own with BLAS on one thread, as each Ray task has it
    (``ray_training.ONE_THREAD``; OpenBLAS reads it when loaded): then what it computes here, a profile
    or a candidate, has the same bytes as on the cluster."""
    cli = "from powerinfer_tools.commands.cli import main; main()"
    result = subprocess.run([sys.executable, "-c", cli, *map(str, args)], env={**os.environ, **ONE_THREAD["env_vars"]},
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def trained_here(profile, tmp_path_factory):
    """The predictor folder train-predictors writes without --ray."""
    out = tmp_path_factory.mktemp("here") / "pred"
    pitools_on_one_thread("train-predictors", profile, "-o", out, *QUICK)
    return snapshot(out)


def test_the_cluster_writes_what_training_here_writes(cluster, profile, trained_here, tmp_path):
    address, _ = cluster
    result = invoke("train-predictors", profile, "-o", tmp_path / "pred", *QUICK, "--ray", address)
    assert result.exit_code == 0, result.output
    assert snapshot(tmp_path / "pred") == trained_here


def test_a_worker_killed_mid_task_is_retried(cluster, profile, trained_here, tmp_path):
    address, crashes = cluster
    (crashes / "crash-once-1").touch()  # layer 1's first attempt kills its worker process
    result = invoke("train-predictors", profile, "-o", tmp_path / "pred", *QUICK, "--ray", address)
    assert result.exit_code == 0, result.output
    assert not (crashes / "crash-once-1").exists(), "no task of layer 1 ran, or none crashed"
    assert snapshot(tmp_path / "pred") == trained_here


def test_a_layer_failing_every_time_is_one_error_and_the_rerun_resumes(cluster, profile, trained_here, tmp_path):
    address, crashes = cluster
    (crashes / "crash-always-1").touch()
    try:
        fails("train-predictors", profile, "-o", tmp_path / "pred", *QUICK, "--ray", address,
              match="layer 1: predictor training failed on the Ray cluster")
    finally:
        (crashes / "crash-always-1").unlink()
    result = invoke("train-predictors", profile, "-o", tmp_path / "pred", *QUICK, "--ray", address)
    assert result.exit_code == 0, result.output
    assert snapshot(tmp_path / "pred") == trained_here


@pytest.mark.slow
def test_convert_on_the_cluster_writes_the_same_file(cluster, sparse_tiny, tmp_path):
    address, crashes = cluster
    (crashes / "crash-once-0").touch()  # proof that a task trained layer 0 (it crashes once, then passes)
    for name, ray in (("here", ()), ("cluster", ("--ray", address))):
        pitools_on_one_thread("convert", sparse_tiny, "-o", tmp_path / f"{name}.gguf", "--tokens", 3000, "-q", *ray)
    assert not (crashes / "crash-once-0").exists()
    assert (tmp_path / "here.gguf").read_bytes() == (tmp_path / "cluster.gguf").read_bytes()


@pytest.mark.slow
def test_a_mixture_trains_a_task_per_expert_with_the_same_result(cluster, tmp_path):
    address, crashes = cluster
    (crashes / "crash-once-5").touch()  # unit 5: layer 1's expert 1 (2 layers of 4 experts)
    for name, ray in (("here", ()), ("cluster", ("--ray", address))):
        pitools_on_one_thread("synth", "--shape", "test-tiny-moe", "-o", tmp_path / f"{name}.powerinfer.gguf",
                              "--profile-tokens", 1600, "--epochs", 1, "-q", *ray)
    assert not (crashes / "crash-once-5").exists(), "no task trained layer 1's expert 1"
    assert (tmp_path / "here.powerinfer.gguf").read_bytes() == (tmp_path / "cluster.powerinfer.gguf").read_bytes()
