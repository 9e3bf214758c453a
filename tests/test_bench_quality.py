"""pitools bench's quality pass (benchmarking/agreement.py): the recall the runtime's firing meter counts
against the reference engine's own count, and agreement figures that move when the predictors do."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from formats.constants import SPARSE_THRESHOLD_KEY, predictor_names
from powerinfer_tools.benchmarking.agreement import decode_agreement
from powerinfer_tools.benchmarking.bench import bench_tokens
from powerinfer_tools.commands.cli import cli
from powerinfer_tools.conversion.gguf_source import GGUFSource
from powerinfer_tools.formats.model_file import open_model_file
from powerinfer_tools.models import load_model
from powerinfer_tools.profiling.perplexity import predictor_chooser
from powerinfer_tools.runtime.loader import load_runtime_model
from powerinfer_tools.runtime.selection_meter import SelectionMeter

PROMPT, STEPS = 48, 32


@pytest.fixture
def files(synthesized_tiny):
    """The synthesized PowerInfer file, its dense twin, and the bench's tokens for them."""
    path = synthesized_tiny.powerinfer
    return path, path.with_name("tiny.gguf"), bench_tokens(path, PROMPT + STEPS)


def reference_recall(dense_twin, sparse_file, tokens) -> dict:
    """The reference engine (NumPy, float32 weights dequantized from the dense twin) computing the
    neurons the file's own predictors choose, all tokens in one block; counted over the positions the
    bench decodes one at a time."""
    model = load_model(GGUFSource(dense_twin))
    stored = open_model_file(sparse_file)
    predictors = [tuple(stored[name].dequantize() for name in predictor_names(i)) for i in range(model.spec.n_layers)]
    choose = predictor_chooser(float(stored.get(SPARSE_THRESHOLD_KEY)), predictors)
    meter = SelectionMeter.zeros(model.spec.n_layers)

    def select(layer, residual, fired):
        chosen = choose(layer, residual, fired)
        meter.add(layer, chosen[PROMPT:], fired[PROMPT:])
        return chosen

    model.neuron_selector = select
    model.forward(tokens[: PROMPT + STEPS], model.new_cache())
    return meter.summary()


def test_the_recall_the_bench_reports_is_the_reference_engines(files):
    sparse_file, dense_twin, tokens = files
    ours = decode_agreement(load_runtime_model(sparse_file, use_split=False, neuron_choice="predictor"), tokens,
                            PROMPT, STEPS)
    reference = reference_recall(dense_twin, sparse_file, tokens)
    # Not equal: the runtime multiplies q8_0-encoded activations, so a few scores near the threshold differ.
    assert ours.selection["recall"] == pytest.approx(reference["recall"], abs=0.02)
    assert ours.selection["computed_density"] == pytest.approx(reference["computed_density"], abs=0.01)
    assert ours.selection["fired_density"] == pytest.approx(reference["fired_density"], abs=0.01)
    assert 0.5 < ours.selection["recall"] < 1  # the predictors miss some: a count, not a constant
    assert ours.steps == STEPS and ours.scored == STEPS - 1  # the text ends after the last step's token


@pytest.mark.parametrize("threshold, recall", [(-np.inf, 1.0), (np.inf, 0.0)])
def test_agreement_follows_what_the_predictors_choose(small_powerinfer_file, threshold, recall):
    # A model whose FFNs matter (synth's add 1% to the residual stream: computing none barely moves its logits).
    tokens = bench_tokens(small_powerinfer_file, 32)  # its context window
    model = load_runtime_model(small_powerinfer_file, use_split=False, neuron_choice="predictor")
    for layer in model.layers:  # before the first step builds the compiled decoder, which copies them
        layer.dense.predictor.threshold = threshold
    q = decode_agreement(model, tokens, 8, 24)
    assert q.selection["recall"] == recall and q.selection["computed_density"] == recall
    if recall:  # every neuron: dense, up to the sparse kernels' order of summation
        assert q.top1 == 1.0 and q.kl_max < 1e-4
        assert q.sparse_perplexity == pytest.approx(q.dense_perplexity, rel=1e-3)
    else:
        assert q.kl_mean > 0.01 and q.sparse_perplexity != pytest.approx(q.dense_perplexity, rel=0.01)
    assert model.firing_meter is None  # left as found: later steps are not metered


def test_too_few_tokens_for_the_steps_is_refused(files):
    sparse_file, _, tokens = files
    with pytest.raises(ValueError, match="need more than"):
        decode_agreement(load_runtime_model(sparse_file, use_split=False), tokens, PROMPT, STEPS + 1)


def test_the_bench_reports_quality_beside_speed(files):
    sparse_file = files[0]
    args = ["bench", str(sparse_file), "--hardware", "rtx4090", "--runs", "1", "-n", "4", "-p", "8", "--threads", "1",
            "--mode", "sparse", "--baseline", "none", "-q"]
    rep = json.loads(CliRunner().invoke(cli, args + ["--json"]).output)
    q = rep["quality"]
    assert q["steps"] == 4 and 0 <= q["top1"] <= 1 and q["kl_mean"] >= 0 and 0 < q["selection"]["recall"] <= 1
    text = CliRunner().invoke(cli, args)
    assert text.exit_code == 0 and "quality (off the clock, 4 decoding steps" in text.output
    assert "predictors' recall" in text.output
    skipped = json.loads(CliRunner().invoke(cli, args + ["--json", "--quality-steps", "0"]).output)
    assert "quality" not in skipped
