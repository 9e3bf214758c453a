"""`pitools bench --memory-limit`: every engine process in a memory cgroup of its own, page cache counted."""

from __future__ import annotations

import pytest
from cli_checks import fails

from powerinfer_tools.benchmarking.bench import (
    SPARSE,
    BenchSettings,
    format_report,
    report,
    run_bench,
)
from powerinfer_tools.benchmarking.memory_limit import MemoryLimit
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
