"""`pitools run` loads the compiled kernels with OpenMP's waiting threads asleep when other work holds the cores
now: spinning threads there wait out a scheduler slice at every join (docs/lab/benchmarks.md, "pitools run and the
bench's engine"); on idle cores they spin, whatever the load average of the minutes before says."""

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


def run_at_load(monkeypatch, model: str, running: int, *options: str, load_average: float = 0.0):
    monkeypatch.setattr(kernels, "others_running", lambda: running)
    monkeypatch.setattr(runtime_options.os, "getloadavg", lambda: (load_average,) * 3)
    monkeypatch.setattr(runtime_options.os, "cpu_count", lambda: 2)
    result = CliRunner().invoke(cli, ["run", model, "-n", "2", *options])
    assert result.exit_code == 0, result.output


def test_busy_cores_load_the_kernels_with_passive_waits_and_leave_the_environment_as_it_was(
        monkeypatch, policy_at_kernel_load, model_file):
    run_at_load(monkeypatch, model_file, 3, "--threads", "2")
    assert policy_at_kernel_load[:1] == ["passive"]
    assert "OMP_WAIT_POLICY" not in os.environ


def test_idle_cores_keep_openmp_spinning(monkeypatch, policy_at_kernel_load, model_file):
    run_at_load(monkeypatch, model_file, 0, "--threads", "2", load_average=4.5)  # minutes of past work
    assert "passive" not in policy_at_kernel_load
    run_at_load(monkeypatch, model_file, 1, "--threads", "1")  # one thread: one idle core is enough
    assert "passive" not in policy_at_kernel_load


def test_a_policy_the_user_set_is_kept(monkeypatch, policy_at_kernel_load, model_file):
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    run_at_load(monkeypatch, model_file, 3, "--threads", "2")
    assert os.environ["OMP_WAIT_POLICY"] == "active"


def test_running_threads_are_counted_now_without_this_one():
    assert 0 <= kernels.others_running(samples=3, interval=0) < 10_000


def test_run_loads_the_compiled_paths_before_it_times_tokens(monkeypatch, model_file):
    from powerinfer_tools.commands import run as run_command
    from powerinfer_tools.runtime.llm import LLM

    order = []
    monkeypatch.setattr(run_command, "load_compiled", lambda engine: order.append("warm"))
    generate = LLM.generate
    monkeypatch.setattr(LLM, "generate", lambda self, *a, **k: order.append("timed") or generate(self, *a, **k))
    result = CliRunner().invoke(cli, ["run", model_file, "-n", "2", "--kernels", "wait"])
    assert result.exit_code == 0, result.output
    assert order == (["warm", "timed"] if kernels.available() else ["timed"])
