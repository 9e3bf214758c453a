"""pitools bench: structure of the report, ratios computed from the measured runs (never timing thresholds)."""

from __future__ import annotations

import json
import statistics

import pytest
from click.testing import CliRunner

from powerinfer_tools.benchmarking.bench import (
    DENSE,
    LLAMA_CPP,
    SPARSE,
    BenchSettings,
    EngineResult,
    Run,
    format_report,
    report,
    run_bench,
)
from powerinfer_tools.commands.cli import cli

RATIO_KEYS = {"sparse_vs_llamacpp_generation", "dense_vs_llamacpp_generation", "sparse_vs_llamacpp_prompt"}


def fake(name: str, prompt_seconds: list[float], generation_seconds: list[float], settings: BenchSettings):
    result = EngineResult(name, f"{name}.gguf", file_bytes=1000, kv_bytes=100, peak_rss=2000, baseline_rss=500,
                          settings=settings)
    result.runs = [Run(p, g, bytes_per_token=500.0, density=0.2 if name == SPARSE else None)
                   for p, g in zip(prompt_seconds, generation_seconds)]
    return result


def test_ratios_are_medians_of_per_round_ratios():
    settings = BenchSettings(prompt_tokens=10, generate=20, runs=3)
    results = {
        SPARSE: fake(SPARSE, [1.0, 2.0, 1.0], [1.0, 1.0, 4.0], settings),
        DENSE: fake(DENSE, [1.0, 1.0, 1.0], [2.0, 2.0, 2.0], settings),
        LLAMA_CPP: fake(LLAMA_CPP, [0.5, 0.5, 0.5], [2.0, 1.0, 2.0], settings),
    }
    rep = report(results, settings, bandwidth_gbs=1e-6, bandwidth_source="test")
    # generation tokens/s per round: sparse 20, 20, 5; llama.cpp 10, 20, 10 -> ratios 2, 1, 0.5
    assert rep["sparse_vs_llamacpp_generation"] == 1.0
    assert rep["dense_vs_llamacpp_generation"] == statistics.median([1.0, 0.5, 1.0])
    assert rep["sparse_vs_llamacpp_prompt"] == statistics.median([0.5, 0.25, 0.5])
    sparse = rep["engines"][SPARSE]
    assert sparse["generation_tokens_per_s"] == 20.0 and sparse["prompt_tokens_per_s"] == 10.0
    assert sparse["implied_gbs"] == pytest.approx(20.0 * 500.0 / 1e9)
    assert sparse["bandwidth_fraction"] == pytest.approx(sparse["implied_gbs"] / 1e-6)
    assert sparse["rss_budget"] == int(1100 * 1.15)
    assert "sparse / llama.cpp generation 1.00x" in format_report(rep)


def test_no_baseline_means_no_ratios():
    settings = BenchSettings(runs=1)
    rep = report({SPARSE: fake(SPARSE, [1.0], [1.0], settings)}, settings, None)
    assert not RATIO_KEYS & set(rep)
    assert rep["engines"][SPARSE]["bandwidth_fraction"] is None
    format_report(rep)


@pytest.fixture
def model(synthesized_tiny):
    """A synthesized PowerInfer file; its dense twin, tiny.gguf, lies beside it."""
    return synthesized_tiny.powerinfer


def test_every_engine_runs_in_turn(model):
    settings = BenchSettings(prompt_tokens=8, generate=3, runs=2, threads=1)
    results = run_bench(model, model.with_name("tiny.gguf"), settings)
    assert set(results) == {SPARSE, DENSE, LLAMA_CPP}
    for r in results.values():
        assert len(r.runs) == 2 and r.peak_rss >= r.baseline_rss > 0 and r.kv_bytes > 0
        assert all(run.prompt_seconds > 0 and run.generation_seconds > 0 and run.bytes_per_token > 0 for run in r.runs)
    # Sparse reads fewer bytes per token than dense, which reads what llama.cpp reads (plus nothing).
    assert results[SPARSE].runs[0].bytes_per_token < results[DENSE].runs[0].bytes_per_token
    assert 0 < results[SPARSE].runs[0].density < 1 and results[DENSE].runs[0].density == 1


def test_cli_json_has_the_ratio_keys(model):
    result = CliRunner().invoke(cli, ["bench", str(model), "--hardware", "rtx4090", "--runs", "1", "-n", "2",
                                      "-p", "4", "--threads", "1", "--json", "-q"])
    assert result.exit_code == 0, result.output
    rep = json.loads(result.output)
    assert RATIO_KEYS <= set(rep)
    sparse, base = rep["engines"][SPARSE], rep["engines"][LLAMA_CPP]
    assert rep["sparse_vs_llamacpp_generation"] == pytest.approx(
        sparse["generation_tokens_per_s"] / base["generation_tokens_per_s"])  # one run: the plain ratio
    assert rep["settings"]["threads"] == 1 and rep["omp_wait_policy"]


def test_cli_wants_a_baseline_file(tmp_path, model):
    lone = tmp_path / "lone.powerinfer.gguf"
    lone.write_bytes(model.read_bytes())
    result = CliRunner().invoke(cli, ["bench", str(lone), "--hardware", "rtx4090"])
    assert result.exit_code == 1 and "--baseline-model" in result.output
