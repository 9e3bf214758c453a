"""``--ray ADDRESS``: profiling and predictor training on a real two-node Ray cluster started on this
machine write exactly what one process writes, survive a worker killed mid-task, and end with one error
line when a window or a layer fails on every attempt; without Ray, ``--ray`` says how to install it."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from cli_checks import fails, invoke, snapshot
from ray_cluster import two_nodes
from synthetic_profiles import write_synthetic_profile
from tiny_models import run_profiler

from powerinfer_tools.benchmarking.synth import HARDNESS, SHAPES, write_checkpoint
from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.cluster.ray_session import CRASHES_VARIABLE, INSTALL_HINT, ONE_THREAD
from powerinfer_tools.models import load_model

# Quick training settings of train-predictors (the tiny model's two layers train in seconds).
QUICK = ("--epochs", "2", "--budget", "0.3", "--recall", "0.9", "--min-precision", "0.2", "-q")


def test_without_ray_the_option_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    fails("train-predictors", tmp_path, "-o", tmp_path / "pred", "--ray", "127.0.0.1:1", match=INSTALL_HINT)
    assert not (tmp_path / "pred").exists()


def test_an_address_where_no_cluster_answers_is_one_error(tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))  # bound, not listening: connections to it are refused
        address = f"127.0.0.1:{unused.getsockname()[1]}"
        fails("train-predictors", tmp_path, "-o", tmp_path / "pred", "--ray", address,
              match=f"--ray {address}: no Ray cluster answers there")
    assert not (tmp_path / "pred").exists()


@pytest.fixture(scope="module")
def cluster():
    """A head and a second node of one CPU each (``ray_cluster.two_nodes``); yields (address, crash folder)."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    with tempfile.TemporaryDirectory(prefix="pitools-ray-crashes-") as crashes, \
            two_nodes({CRASHES_VARIABLE: crashes}) as address:
        yield address, Path(crashes)


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


def fails_every_time(crashes: Path, task: str, *args, match: str) -> None:
    """``pitools ARGS`` with the Ray task (or actor call) named ``task`` dying on every attempt: one error
    line saying ``match``."""
    (crashes / f"crash-always-{task}").touch()
    try:
        fails(*args, match=match)
    finally:
        (crashes / f"crash-always-{task}").unlink()


def resumes_to(folder: Path, expected: dict[str, str], *args) -> None:
    """``pitools ARGS`` run again completes, and ``folder`` then holds ``expected`` (a ``snapshot``)."""
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert snapshot(folder) == expected


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
    run = ("train-predictors", profile, "-o", tmp_path / "pred", *QUICK, "--ray", address)
    fails_every_time(crashes, "1", *run, match="layer 1: predictor training failed on the Ray cluster")
    resumes_to(tmp_path / "pred", trained_here, *run)


# The tiny model's held-out text: 2000 tokens in 16 windows of 128 (its context).
PROFILE = ("--tokens", "2000", "--seq-len", "128", "-q")


@pytest.fixture(scope="module")
def profiled_here(sparse_tiny, tmp_path_factory):
    """The profile folder `pitools profile` writes without --ray."""
    out = tmp_path_factory.mktemp("here") / "prof"
    pitools_on_one_thread("profile", sparse_tiny, "-o", out, *PROFILE)
    return snapshot(out)


def test_profiling_on_the_cluster_writes_the_profile_made_here_and_survives_a_lost_worker(
        cluster, sparse_tiny, profiled_here, tmp_path):
    address, crashes = cluster
    (crashes / "crash-once-window-3").touch()  # window 3's first attempt kills its worker process
    result = invoke("profile", sparse_tiny, "-o", tmp_path / "prof", *PROFILE, "--ray", address)
    assert result.exit_code == 0, result.output
    assert not (crashes / "crash-once-window-3").exists(), "no task profiled window 3, or none crashed"
    assert snapshot(tmp_path / "prof") == profiled_here


def test_a_window_failing_every_time_is_one_error_and_the_rerun_resumes(cluster, sparse_tiny, profiled_here,
                                                                        tmp_path):
    address, crashes = cluster
    run = ("profile", sparse_tiny, "-o", tmp_path / "prof", *PROFILE, "--ray", address)
    fails_every_time(crashes, "window-5", *run, match="profiling window 5 (tokens 640-767) failed on the Ray cluster")
    assert not (tmp_path / "prof" / "report.json").exists(), "a failed profile reported as if complete"
    resumes_to(tmp_path / "prof", profiled_here, *run)


def test_ranges_of_layers_on_actors_write_the_profile_made_here_and_survive_a_lost_actor(
        cluster, sparse_tiny, profiled_here, tmp_path):
    """--layer-ranges 2: an actor per layer of the two, on the two nodes, the stream passed between them."""
    address, crashes = cluster
    (crashes / "crash-once-layers-1-window-4").touch()  # layer 1's actor dies on window 4, once
    result = invoke("profile", sparse_tiny, "-o", tmp_path / "prof", *PROFILE, "--ray", address, "--layer-ranges", 2)
    assert result.exit_code == 0, result.output
    assert not (crashes / "crash-once-layers-1-window-4").exists(), "no actor ran window 4 on layer 1, or none crashed"
    assert snapshot(tmp_path / "prof") == profiled_here


def test_ranges_of_layers_are_checked_before_anything_is_written(cluster, sparse_tiny, tmp_path):
    address, _ = cluster
    fails("profile", sparse_tiny, "-o", tmp_path / "a", *PROFILE, "--ray", address, "--layer-ranges", 3,
          match="--layer-ranges 3: the model has only 2 layers")
    fails("profile", sparse_tiny, "-o", tmp_path / "b", *PROFILE, "--layer-ranges", 2,
          match="--layer-ranges runs the ranges on a Ray cluster: give --ray too")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_range_failing_every_time_is_one_error_naming_window_and_layers(cluster, sparse_tiny, tmp_path):
    address, crashes = cluster
    # Window 0: the actor's first call. A later one would race its predecessor, whose reply the crash
    # can lose before it leaves the process, so that the predecessor fails on every attempt as well.
    fails_every_time(crashes, "layers-0-window-0", "profile", sparse_tiny, "-o", tmp_path / "prof", *PROFILE,
                     "--ray", address, "--layer-ranges", 2,
                     match="profiling window 0 (tokens 0-127) on layer 0 failed on the Ray cluster")
    assert not (tmp_path / "prof" / "report.json").exists(), "a failed profile reported as if complete"


@pytest.mark.slow
def test_sizes_the_guess_did_not_try_are_trained_in_tasks_of_their_own(cluster, tmp_path):
    """Layer 0 needs hidden 16, layer 1 passes at the smallest, 8: layer 1's task searched ahead from 8
    alone, its real search starts at layer 0's 16, and the driver has 16 and 12 trained in tasks of their own."""
    address, _ = cluster
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4000, 24)).astype(np.float32)
    x[:, 0] = 1  # a constant feature lets the predictor draw thresholds without a bias
    planes = rng.standard_normal((48, 23))
    spread = x[:, 1:] @ (planes / np.linalg.norm(planes, axis=1, keepdims=True)).T > 1.0  # each its own hyperplane
    skewed = np.zeros((4000, 48), bool)
    skewed[:, :6] = True  # the same few neurons fire on every token
    write_synthetic_profile(tmp_path / "prof", x, [spread, skewed])
    pitools_on_one_thread("train-predictors", tmp_path / "prof", "-o", tmp_path / "here", "--budget", 1, "-q")
    result = invoke("train-predictors", tmp_path / "prof", "-o", tmp_path / "cluster", "--budget", 1, "-q",
                    "--ray", address)
    assert result.exit_code == 0, result.output
    layers = json.loads((tmp_path / "cluster" / "predictors.json").read_text())["layers"]
    assert [layer["hidden"] for layer in layers] == [16, 8]
    assert [t["hidden"] for t in layers[1]["tried"]] == [16, 12, 8]
    assert snapshot(tmp_path / "cluster") == snapshot(tmp_path / "here")


@pytest.mark.slow
def test_convert_on_the_cluster_writes_the_same_file(cluster, sparse_tiny, tmp_path):
    address, crashes = cluster
    # Proof that tasks profiled window 1 and trained layer 0 (each crashes once, then passes).
    (crashes / "crash-once-window-1").touch()
    (crashes / "crash-once-0").touch()
    for name, ray in (("here", ()), ("cluster", ("--ray", address))):
        pitools_on_one_thread("convert", sparse_tiny, "-o", tmp_path / f"{name}.gguf", "--tokens", 3000, "-q", *ray)
    assert not (crashes / "crash-once-window-1").exists()
    assert not (crashes / "crash-once-0").exists()
    assert (tmp_path / "here.gguf").read_bytes() == (tmp_path / "cluster.gguf").read_bytes()


@pytest.mark.slow
def test_a_tinyllama_shape_model_is_profiled_and_synthesised_on_the_cluster_as_here(cluster, tmp_path):
    """TinyLlama's widths (d_model 2048, d_ff 5632), two layers: windows and layers of a real size, the
    model (0.8 GB in float32) moved to the workers through the object store, or read a range of layers
    per actor; then `synth --layers 2`, whose predictors train on the cluster, writes the same file."""
    address, _ = cluster
    shape = dataclasses.replace(SHAPES["tinyllama-1.1b"], n_layers=2)
    write_checkpoint(tmp_path / "checkpoint", shape, HARDNESS["medium"].planting(shape, 0.1, seed=0))
    profile = (tmp_path / "checkpoint", "--corpus", BUNDLED_MODEL / "heldout.txt", "--tokens", 1024, "--seq-len", 256,
               "-q")
    ways = {"here": (), "cluster": ("--ray", address), "ranges": ("--ray", address, "--layer-ranges", 2)}
    for name, ray in ways.items():
        pitools_on_one_thread("profile", *profile, "-o", tmp_path / f"prof-{name}", *ray)
    assert snapshot(tmp_path / "prof-cluster") == snapshot(tmp_path / "prof-here")
    assert snapshot(tmp_path / "prof-ranges") == snapshot(tmp_path / "prof-here")
    for name, ray in (("here", ()), ("cluster", ("--ray", address))):
        pitools_on_one_thread("synth", "--shape", "tinyllama-1.1b", "--layers", 2, "-o",
                              tmp_path / f"{name}.powerinfer.gguf", "-q", *ray)
    assert (tmp_path / "cluster.powerinfer.gguf").read_bytes() == (tmp_path / "here.powerinfer.gguf").read_bytes()


@pytest.mark.slow
def test_a_mixture_trains_a_task_per_expert_with_the_same_result(cluster, tmp_path):
    address, crashes = cluster
    (crashes / "crash-once-5").touch()  # unit 5: layer 1's expert 1 (2 layers of 4 experts)
    for name, ray in (("here", ()), ("cluster", ("--ray", address))):
        pitools_on_one_thread("synth", "--shape", "test-tiny-moe", "-o", tmp_path / f"{name}.powerinfer.gguf",
                              "--profile-tokens", 1600, "--epochs", 1, "-q", *ray)
    assert not (crashes / "crash-once-5").exists(), "no task trained layer 1's expert 1"
    assert (tmp_path / "here.powerinfer.gguf").read_bytes() == (tmp_path / "cluster.powerinfer.gguf").read_bytes()
