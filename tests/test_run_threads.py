"""`pitools run` loads the compiled kernels with OpenMP's waiting threads asleep when the cores are busy:
spinning threads there wait out a scheduler slice at every join (docs/lab/benchmarks.md, "pitools run and the
bench's engine")."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from powerinfer_tools import kernels
from powerinfer_tools.commands import options as runtime_options
from powerinfer_tools.commands.cli import cli


@pytest.fixture
def policy_at_kernel_load(monkeypatch):
    """What OMP_WAIT_POLICY was when `pitools run` loaded the kernels (None: unset); they are then refused,
    and the run goes on with the reference."""
    seen = []
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(kernels, "_backend", lambda: seen.append(os.environ.get("OMP_WAIT_POLICY")) or "spied on")
    return seen


@pytest.fixture
def model_file(bundled_gguf) -> str:
    return str(bundled_gguf("q8_0"))  # a model file: the runtime loads the kernels (a checkpoint folder's does not)


def run_at_load(monkeypatch, model: str, load: float, *options: str):
    monkeypatch.setattr(runtime_options.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(runtime_options.os, "cpu_count", lambda: 2)
    result = CliRunner().invoke(cli, ["run", model, "-n", "2", *options])
    assert result.exit_code == 0, result.output


def test_busy_cores_load_the_kernels_with_passive_waits_and_leave_the_environment_as_it_was(
        monkeypatch, policy_at_kernel_load, model_file):
    run_at_load(monkeypatch, model_file, 3.0, "--threads", "2")
    assert policy_at_kernel_load[:1] == ["passive"]
    assert "OMP_WAIT_POLICY" not in os.environ


def test_idle_cores_keep_openmp_spinning(monkeypatch, policy_at_kernel_load, model_file):
    run_at_load(monkeypatch, model_file, 0.1, "--threads", "2")
    assert "passive" not in policy_at_kernel_load
    run_at_load(monkeypatch, model_file, 1.0, "--threads", "1")  # one thread: one idle core is enough
    assert "passive" not in policy_at_kernel_load


def test_a_policy_the_user_set_is_kept(monkeypatch, policy_at_kernel_load, model_file):
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    run_at_load(monkeypatch, model_file, 3.0, "--threads", "2")
    assert os.environ["OMP_WAIT_POLICY"] == "active"
