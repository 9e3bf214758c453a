"""--mode auto (issue 32, "never slower than dense"): sparse where a decoded token takes less time than dense on
this machine, measured once per model file and kept (``runtime/sparse_verdict.py``), else dense, and said."""

from __future__ import annotations

import pytest
from cli_checks import invoke

from powerinfer_tools import kernels
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.runtime import sparse_verdict, warmup
from powerinfer_tools.runtime.llm import LLM
from powerinfer_tools.runtime.loader import load_runtime_model
from powerinfer_tools.runtime.sparse_verdict import MIN_GAIN, Verdict
from powerinfer_tools.runtime.tokenizer import GGUFTokenizer

MEASURED = sparse_verdict.verdict  # the real one: conftest's sparse_pays replaces it in every test


def test_sparse_pays_only_with_a_gain_beyond_the_noise():
    assert Verdict(1.0, MIN_GAIN).pays and Verdict(1.0, 2.0).pays
    assert not Verdict(1.0, MIN_GAIN * 0.99).pays and not Verdict(2.0, 1.0).pays
    assert Verdict(2.0, 1.0).describe() == "sparse 0.50x dense's decoding speed here"


def test_measuring_times_both_modes_and_leaves_the_model_as_it_was(small_powerinfer_file):
    model = load_runtime_model(small_powerinfer_file)
    model.mode = FFNMode.SPARSE
    stats = model.stats
    found = sparse_verdict.measure(model, GGUFTokenizer(model.metadata).encode(sparse_verdict.TEXT))
    assert found.sparse_step_s > 0 and found.dense_step_s > 0
    assert model.mode is FFNMode.SPARSE and model.stats is stats and stats.steps == 0


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """The real ``verdict``, keeping verdicts in ``tmp_path``, with ``measure`` replaced by a counted stand-in
    whose sparse steps take ``answer[0]`` seconds and dense ones ``answer[1]``."""
    monkeypatch.setattr(warmup, "marker_folder", lambda: tmp_path)
    calls, answer = [], [1.0, 2.0]

    def measure(model, prompt):
        calls.append(len(prompt))
        return Verdict(*answer)

    monkeypatch.setattr(sparse_verdict, "measure", measure)
    monkeypatch.setattr(sparse_verdict, "verdict", MEASURED)
    return calls, answer


def test_a_verdict_is_measured_once_per_file_and_thread_count(small_powerinfer_file, counted, tmp_path):
    calls, _ = counted
    model = load_runtime_model(small_powerinfer_file)
    tokenizer, options, said = GGUFTokenizer(model.metadata), warmup.LoadOptions(), []
    assert sparse_verdict.verdict(model, tokenizer, options, 2, said.append) == Verdict(1.0, 2.0)
    assert len(calls) == 1 and said == ["measuring whether sparse FFNs pay on this machine for this model (once)"]
    [kept] = tmp_path.glob("pitools-sparse-*.json")
    assert sparse_verdict.verdict(model, tokenizer, options, 2, said.append) == Verdict(1.0, 2.0)
    assert len(calls) == 1 and len(said) == 1  # kept: neither measured nor said again
    sparse_verdict.verdict(model, tokenizer, options, 1)  # another thread count is another verdict
    assert len(calls) == 2 and len(list(tmp_path.glob("pitools-sparse-*.json"))) == 2
    kept.write_text("{not json")  # a damaged verdict is measured again
    sparse_verdict.verdict(model, tokenizer, options, 2)
    assert len(calls) == 3


@pytest.mark.parametrize(("answer", "mode"), [((2.0, 1.0), FFNMode.DENSE), ((1.0, 2.0), FFNMode.SPARSE)],
                         ids=["sparse-slower", "sparse-faster"])
def test_auto_mode_runs_whichever_is_faster_and_says_why(small_powerinfer_file, counted, answer, mode):
    calls, kept_answer = counted
    kept_answer[:] = answer
    llm = LLM.load(small_powerinfer_file)  # auto, the default
    assert llm.engine.mode is mode and len(calls) == 1
    assert llm.description.startswith(f"runtime, {mode.value} FFN (auto: {Verdict(*answer).describe()})")
    for asked in ("sparse", "dense"):  # asked for: no verdict
        assert LLM.load(small_powerinfer_file, mode=asked).engine.mode is FFNMode(asked)
    assert len(calls) == 1


def test_no_verdict_on_the_numpy_reference_kernels(small_powerinfer_file, counted):
    calls, kept_answer = counted
    kept_answer[:] = (2.0, 1.0)
    try:
        llm = LLM.load(small_powerinfer_file, kernels="reference")
    finally:
        kernels.use_reference(None)
    assert llm.engine.mode is FFNMode.SPARSE and calls == []  # their speeds say nothing of the compiled ones


def test_run_mode_auto_on_the_command_line(small_powerinfer_file, counted, monkeypatch):
    calls, kept_answer = counted
    kept_answer[:] = (2.0, 1.0)
    result = invoke("run", small_powerinfer_file, "-n", "2", "-p", "def", "--mode", "auto")
    assert result.exit_code == 0, result.output
    assert "dense FFN (auto: sparse 0.50x dense's decoding speed here)" in result.stderr
    assert "auto: sparse where that decodes faster than dense" in " ".join(invoke("run", "--help").stdout.split())
    monkeypatch.delenv("PITOOLS_MODE")
    assert "dense FFN (auto: " in invoke("run", small_powerinfer_file, "-n", "1", "-p", "def").stderr  # the default
