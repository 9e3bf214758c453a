"""pitools bench: structure of the report, ratios computed from the measured runs (never timing thresholds),
each engine alone in its process, llama.cpp's buffer types, PowerInfer's runtime through a fake binary."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from powerinfer_tools.formats.model_file import open_model_file

from powerinfer_tools.benchmarking import bench as bench_module
from powerinfer_tools.benchmarking.bench import (
    DENSE,
    LLAMA_CPP,
    POWERINFER,
    SPARSE,
    BenchSettings,
    EngineResult,
    Run,
    bench_tokens,
    engine_specs,
    format_report,
    llama_cpp_buffers,
    predictor_summary,
    report,
    run_bench,
)
from powerinfer_tools.benchmarking.llamacpp import AmxStatus, Buffers, load_llama_cpp
from powerinfer_tools.commands.cli import cli
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.runtime.tokenizer import GGUFTokenizer

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
    # sparse 1, 1, 4 s against dense 2, 2, 2 s per round -> 2, 2, 0.5
    assert rep["sparse_vs_dense_generation"] == 2.0
    assert "sparse / our dense generation 2.00x" in format_report(rep)
    assert "\nsparsity pays on this machine for this model (sparse 2.00x our dense generation)" in format_report(rep)


def test_the_report_says_where_sparsity_does_not_pay():
    settings = BenchSettings(runs=1)
    rep = report({SPARSE: fake(SPARSE, [1.0], [2.1], settings), DENSE: fake(DENSE, [1.0], [2.0], settings)},
                 settings, None)
    assert "sparsity does not pay on this machine for this model (sparse 0.95x our dense generation)" in (
        format_report(rep))


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


@pytest.fixture
def engine_processes(monkeypatch):
    """Every process the bench starts, recorded with its environment; starting one while another it
    started is still alive fails the test."""
    started = []
    real_popen = subprocess.Popen

    def popen(args, **kwargs):
        alive = [(p.args, env) for p, env in started if p.poll() is None]
        assert not alive, f"{args} started while {alive} is alive"
        process = real_popen(args, **kwargs)
        started.append((process, kwargs.get("env", {})))
        return process

    monkeypatch.setattr(subprocess, "Popen", popen)
    return started


def test_every_engine_runs_in_turn(model, engine_processes, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    settings = BenchSettings(prompt_tokens=8, generate=3, runs=2, threads=1)
    results = run_bench(model, model.with_name("tiny.gguf"), settings)
    assert set(results) == {SPARSE, DENSE, LLAMA_CPP}
    for r in results.values():
        assert len(r.runs) == 2 and r.peak_rss >= r.baseline_rss > 0 and r.kv_bytes > 0
        assert all(run.prompt_seconds > 0 and run.generation_seconds > 0 and run.bytes_per_token > 0 for run in r.runs)
    # Sparse reads fewer bytes per token than dense, which reads what llama.cpp reads (plus nothing).
    assert results[SPARSE].runs[0].bytes_per_token < results[DENSE].runs[0].bytes_per_token
    assert 0 < results[SPARSE].runs[0].density < 1 and results[DENSE].runs[0].density == 1
    # Each engine alone (engine_processes): a fresh process per engine and round, and no other.
    workers = [env for p, env in engine_processes if p.args[1:3] == ["-m", bench_module.__name__]]
    assert len(workers) == 3 * settings.runs
    assert all(p.returncode is not None for p, _ in engine_processes)
    # Nothing but the thread counts is set: each library's defaults hold.
    assert all(env["OMP_NUM_THREADS"] == "1" and "OMP_WAIT_POLICY" not in env for env in workers)
    rep = report(results, settings, None)
    assert rep["omp_wait_policy"] == "unset"
    for engine in rep["engines"].values():
        assert engine["settings"]["threads"] == 1 and "omp_wait_policy" not in engine["settings"]
    llama = rep["engines"][LLAMA_CPP]["settings"]
    assert llama["repack"] == ("CPU_REPACK" in llama["extra_buffer_types"])
    assert llama["amx"].startswith(("on", "off"))
    assert rep["cpu"]["model"] and isinstance(rep["cpu"]["amx"], bool)
    assert f"CPU: {rep['cpu']['model']}" in format_report(rep)


def test_an_engine_process_that_dies_at_start_is_one_error_not_a_hang(model, monkeypatch):
    real_popen = subprocess.Popen

    def popen(args, **kwargs):  # the engine's interpreter dies before it reads anything
        return real_popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(PitoolsError, match="the engine's process died \\(signal SIGKILL\\)"):
        run_bench(model, None, BenchSettings(prompt_tokens=8, generate=3, runs=1, threads=1), modes=(SPARSE,))


def test_the_report_states_the_predictability_of_the_model(synthesized_tiny):
    layers = synthesized_tiny.predictors["layers"]
    summary = predictor_summary(synthesized_tiny.powerinfer)
    assert summary["trained"]["worst_recall"] == pytest.approx(min(e["recall"] for e in layers))
    assert summary["trained"]["mean_computed"] == pytest.approx(np.mean([e["predicted_density"] for e in layers]))
    model = open_model_file(synthesized_tiny.powerinfer)
    assert summary["bytes_per_token"] == sum(t.nbytes for t in model.tensors.values() if ".fc" in t.name)
    rep = report({}, BenchSettings(), None, predictors=summary)
    assert rep["predictors"] == summary and f"trained to recall >= {min(e['recall'] for e in layers):.1%}" in format_report(rep)


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


def test_a_set_omp_wait_policy_is_passed_through_and_reported(model, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    specs = engine_specs(model, None, BenchSettings(threads=3), (SPARSE,), None, progress=print)
    assert [reported for _, reported in specs] == [{"threads": 3, "omp_wait_policy": "passive"}]


def test_llama_cpp_turns_off_amx_alone_where_it_faults(model, monkeypatch):
    messages = []
    monkeypatch.setattr(bench_module, "probe_amx",
                        lambda path, threads: (AmxStatus.FAULTS, ["AMX", "CPU_REPACK"], "the probe died with SIGILL"))
    buffers, reported = llama_cpp_buffers(model, 1, messages.append)
    assert buffers is Buffers.REPACK and reported["repack"] and reported["extra_buffer_types"] == ["CPU_REPACK"]
    assert "SIGILL" in reported["amx"] and "AMX" in messages[0]
    monkeypatch.setattr(bench_module, "probe_amx", lambda path, threads: (AmxStatus.ABSENT, ["CPU_REPACK"], ""))
    assert llama_cpp_buffers(model, 1, messages.append)[0] is Buffers.DEFAULT


def test_llama_cpp_repacks_without_amx_and_computes_what_the_plain_kernels_do(model, capfd):
    """The bench's llama.cpp: CPU_REPACK buffers in its log, no AMX, and the logits of the plain
    (no extra buffers) load within q4_0 repacking's rounding (the activations' q8_0 blocks are summed
    in another order)."""
    dense = model.with_name("tiny.gguf")
    tokens = bench_tokens(dense, 24).tolist()

    def logits(buffers: Buffers) -> np.ndarray:
        import llama_cpp

        llm = load_llama_cpp(dense, buffers, n_ctx=64, n_threads=1, verbose=buffers is Buffers.REPACK)
        rows = []
        llm.eval(tokens[:16])
        for token in tokens[16:]:
            llm.eval([token])
            rows.append(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)))
        return np.array(rows)

    repacked = logits(Buffers.REPACK)
    log = capfd.readouterr().err
    assert "CPU_REPACK model buffer" in log and "repack tensor" in log
    assert "AMX model buffer" not in log and "amx repack" not in log
    plain = logits(Buffers.PLAIN)
    error = np.linalg.norm(repacked - plain, axis=1) / np.linalg.norm(plain, axis=1)
    assert error.max() < 1e-2, error
    assert (repacked.argmax(1) == plain.argmax(1)).all()


# --- PowerInfer's runtime, through a fake `main` that prints its timing lines ----------------------

TIMINGS = """llama_print_timings:        load time =     100.00 ms
llama_print_timings:      sample time =       1.00 ms /     3 runs   (    0.33 ms per token,  3000.00 tokens per second)
llama_print_timings: prompt eval time =     400.00 ms /    8 tokens (   50.00 ms per token,    20.00 tokens per second)
llama_print_timings:        eval time =     250.00 ms /     2 runs   (  125.00 ms per token,     8.00 tokens per second)
llama_print_timings:       total time =     700.00 ms
"""


def fake_powerinfer(folder, output: str = TIMINGS, status: int = 0):
    """A stand-in for PowerInfer's main: records its arguments and prompt file, prints ``output``."""
    script = folder / "main"
    script.write_text(f"""#!{sys.executable}
import pathlib, sys
args = sys.argv[1:]
pathlib.Path({str(folder / "args.txt")!r}).write_text("\\n".join(args))
pathlib.Path({str(folder / "prompt.txt")!r}).write_text(open(args[args.index("-f") + 1]).read())
pathlib.Path("main.log").write_text("a log, as the real main writes into its working directory")
sys.stderr.write({output!r})
sys.exit({status})
""")
    script.chmod(0o755)
    return script


def test_powerinfer_is_timed_by_its_printed_timings(model, tmp_path, engine_processes, monkeypatch):
    binary = fake_powerinfer(tmp_path)
    settings = BenchSettings(prompt_tokens=8, generate=3, runs=2, threads=1)
    user_folder = tmp_path / "user"
    user_folder.mkdir()
    monkeypatch.chdir(user_folder)
    result = run_bench(model, None, settings, modes=(), powerinfer=binary)[POWERINFER]
    assert not list(user_folder.iterdir())  # its main.log went to a scratch folder
    assert result.prompt_rates() == [20.0, 20.0]  # 8 tokens in 0.4 s
    assert result.generation_rates() == [8.0, 8.0]  # 2 decoding steps in 0.25 s
    assert result.peak_rss > 0 and len(engine_processes) == 2
    args = (tmp_path / "args.txt").read_text().split("\n")
    assert Path(args[args.index("-m") + 1]).samefile(model) and args[args.index("-t") + 1] == "1"
    assert args[args.index("-n") + 1] == "3" and "--ignore-eos" in args
    # Its prompt is the text of the bench's prompt tokens: it tokenizes back to them.
    tokenizer = GGUFTokenizer(open_model_file(model).metadata)
    assert tokenizer.encode((tmp_path / "prompt.txt").read_text(), add_bos=False) == bench_tokens(model, 8).tolist()
    rep = report({POWERINFER: result}, settings, None)
    assert rep["engines"][POWERINFER]["bytes_per_token"] is None
    assert "powerinfer" in format_report(rep)


@pytest.mark.parametrize("output, status, message", [
    (TIMINGS, 3, "exit status 3"),
    ("llama_print_timings: load time = 1 ms\n", 0, "no llama_print_timings"),
])
def test_powerinfer_failures_are_one_error_line(model, tmp_path, output, status, message):
    binary = fake_powerinfer(tmp_path, output, status)
    with pytest.raises(PitoolsError, match=message):
        run_bench(model, None, BenchSettings(prompt_tokens=8, generate=3, runs=1, threads=1), modes=(),
                  powerinfer=binary)


def test_cli_names_a_missing_powerinfer_binary_in_one_error_line(model, tmp_path):
    result = CliRunner().invoke(cli, ["bench", str(model), "--hardware", "rtx4090", "--baseline", "none",
                                      "--powerinfer", str(tmp_path / "main"), "--runs", "1", "-n", "2", "-p", "4"])
    assert result.exit_code == 1
    errors = [line for line in result.output.splitlines() if line.startswith("pitools: error:")]
    assert len(errors) == 1 and str(tmp_path / "main") in errors[0] and "no such executable" in errors[0]
