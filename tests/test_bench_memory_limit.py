"""`pitools bench --memory-limit`: every engine process in a memory cgroup of its own, page cache counted."""

from __future__ import annotations

import pytest
from cli_checks import fails

from powerinfer_tools.benchmarking import bench as bench_module
from powerinfer_tools.benchmarking.bench import LLAMA_CPP, SPARSE, BenchSettings, format_report, report, run_bench
from powerinfer_tools.benchmarking.llamacpp import Buffers
from powerinfer_tools.benchmarking.memory_limit import MemoryLimit, MemoryLimitExceeded
from powerinfer_tools.errors import PitoolsError


@pytest.fixture
def model(synthesized_tiny):
    """A synthesized PowerInfer file; its dense twin, tiny.gguf, lies beside it."""
    return synthesized_tiny.powerinfer


@pytest.fixture
def cgroup_folder():
    """The folder the bench makes its groups in; the test is skipped where cgroups are not writable."""
    try:
        probe = MemoryLimit(2**30)
    except PitoolsError as exc:
        pytest.skip(f"no writable memory cgroup here: {exc}")
    probe.close()
    yield probe.path.parent
    assert not list(probe.path.parent.glob("pitools-bench-*")), "a group was left behind"


def test_engines_run_under_a_limit_that_fits_them(model, cgroup_folder):
    settings = BenchSettings(prompt_tokens=8, generate=3, runs=1, threads=1, memory_limit=2 * 2**30)
    results = run_bench(model, model.with_name("tiny.gguf"), settings)
    assert all(len(r.runs) == 1 for r in results.values())
    assert "memory limit 2.00 GiB per engine process" in format_report(report(results, settings, None))


def test_an_engine_over_the_limit_is_one_error_naming_it(model, cgroup_folder):
    # 32 MiB: less than the Python interpreter with NumPy, so the kernel kills the engine as it loads.
    settings = BenchSettings(prompt_tokens=8, generate=3, runs=1, threads=1, memory_limit=32 * 2**20)
    with pytest.raises(PitoolsError, match=r"sparse \(.*\): killed by the kernel for exceeding --memory-limit 32.00 MiB"):
        run_bench(model, None, settings, modes=(SPARSE,))


def test_the_limit_must_be_a_size(model):
    fails("bench", model, "--memory-limit", "lots", "--hardware", "rtx4090", match="--memory-limit: cannot read 'lots'")


def test_llama_cpp_killed_at_its_defaults_runs_plain_and_says_so(model, monkeypatch):
    """Under a limit below its repacked weights llama.cpp at its defaults is killed; its best that fits is
    its plain load (weights memory-mapped), which the bench then runs and names in the report."""
    real = bench_module._within_limit
    loads = []

    def within_limit(spec, limit_bytes, run_once):
        loads.append((spec.name, spec.buffers))
        if spec.name == LLAMA_CPP and spec.buffers is not Buffers.PLAIN:
            raise MemoryLimitExceeded("llama.cpp: killed by the kernel for exceeding --memory-limit")
        return real(spec, None, run_once)

    monkeypatch.setattr(bench_module, "_within_limit", within_limit)
    settings = BenchSettings(prompt_tokens=8, generate=3, runs=2, threads=1, memory_limit=2**30)
    results = run_bench(model, model.with_name("tiny.gguf"), settings, modes=(SPARSE,))
    assert [b for name, b in loads if name == LLAMA_CPP][1:] == [Buffers.PLAIN, Buffers.PLAIN]  # tried once
    assert len(results[LLAMA_CPP].runs) == 2
    reported = results[LLAMA_CPP].engine_settings
    assert reported["repack"] is False and "killed under it at its defaults" in reported["memory_limit"]
    assert "memory_limit killed under it" in format_report(report(results, settings, None))
