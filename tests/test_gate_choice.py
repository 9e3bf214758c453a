"""The whole gate choosing a ReLU-family layer's neurons (``runtime.gate_choice``): exact where a predictor
guesses, chosen per layer by the bytes the file says each reads, refused where it would not be exact."""

from __future__ import annotations

import numpy as np
import pytest
from cli_checks import fails
from gguf import GGUFValueType as V
from gguf_fixtures import random_predictors, rewrite_gguf, save_predictors
from tiny_models import TINY_RELU_LLAMA

from powerinfer_tools import kernels
from powerinfer_tools.kernels import batched
from powerinfer_tools.benchmarking.agreement import decode_agreement
from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.conversion.convert import convert
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.constants import PREDICTOR_COMPUTED_KEY, neuron_frequency_key
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.models import load_model
from powerinfer_tools.runtime import engine
from powerinfer_tools.runtime.engine import TokenStats
from powerinfer_tools.runtime.gate_choice import GATE_CHOOSES
from powerinfer_tools.runtime.loader import load_runtime_model

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason=f"compiled kernels unavailable: {kernels.unavailable_reason()}")

N_LAYERS, D_MODEL, D_FF = (TINY_RELU_LLAMA[k] for k in ("num_hidden_layers", "hidden_size", "intermediate_size"))
TOKENS = np.arange(3, 60, 4)


@pytest.fixture(scope="module")
def predicted_file(sparse_tiny, tmp_path_factory):
    """The sparse-firing tiny ReGLU LLaMA in the PowerInfer layout, f32, with random predictors (which miss
    many firing neurons: the gate's choice must not)."""
    root = tmp_path_factory.mktemp("gate-choice")
    save_predictors(root / "predictors", random_predictors(N_LAYERS, D_MODEL, D_FF, hidden=8))
    return convert(str(sparse_tiny), root / "tiny.powerinfer.gguf", "f32", predictors=root / "predictors",
                   progress=False)[0]


def _logits(model, tokens=TOKENS, prompt=4) -> np.ndarray:
    caches = model.new_cache()
    steps = [model.forward(tokens[:prompt], caches)]
    steps += [model.forward(tokens[i : i + 1], caches) for i in range(prompt, len(tokens))]
    return np.concatenate(steps)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled decode", "general decode"])
def test_the_gate_computes_only_the_firing_neurons_and_what_dense_computes(predicted_file, sparse_tiny, compiled):
    """Against the reference engine on the checkpoint's float weights (dense): the same logits, from only the
    neurons that fire, where the random predictors' own choice is far off."""
    reference = load_model(Checkpoint(sparse_tiny))
    theirs = reference.forward(TOKENS, reference.new_cache())
    model = load_runtime_model(predicted_file, neuron_choice="gate")
    assert all(layer.dense.thresholds is GATE_CHOOSES for layer in model.layers)
    model.mode, model.compiled_decoding = FFNMode.SPARSE, compiled
    ours = _logits(model)
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() < 1e-5
    assert (model.decode_path() == "compiled decoder") == compiled
    assert "every neuron's gate, the gate's choice, then each token's kept neurons" in "\n".join(
        model.execution_report())
    assert 0 < model.stats.neurons_active < 0.5 * model.stats.neurons_total  # a sparse-firing model
    by_predictor = load_runtime_model(predicted_file, neuron_choice="predictor")
    by_predictor.mode = FFNMode.SPARSE
    assert np.abs(_logits(by_predictor) - theirs).max() / np.abs(theirs).max() > 1e-3  # what the gate avoids


def test_a_long_prompt_reads_every_down_row_with_the_same_sums(predicted_file, sparse_tiny, monkeypatch):
    """From ``EVERY_DOWN_ROW_TOKENS`` tokens a prompt computes the gate-chosen layers from each token's own up
    products and every down row: the neurons and the logits of sparse mode's own paths, of dense mode and of the
    reference engine."""
    tokens = np.arange(engine.EVERY_DOWN_ROW_TOKENS) % 250 + 3
    reference = load_model(Checkpoint(sparse_tiny))
    theirs = reference.forward(tokens, reference.new_cache())
    model = load_runtime_model(predicted_file, neuron_choice="gate")
    own_up, selected_up = [], batched.selected_up
    monkeypatch.setattr(batched, "selected_up", lambda *args: own_up.append(1) or selected_up(*args))
    logits, computed = {}, {}
    for mode, limit in ((FFNMode.SPARSE, engine.EVERY_DOWN_ROW_TOKENS), (FFNMode.SPARSE, len(tokens) + 1),
                        (FFNMode.DENSE, len(tokens) + 1)):  # then the sparse paths alone, then dense mode
        monkeypatch.setattr(engine, "EVERY_DOWN_ROW_TOKENS", limit)
        model.mode = mode
        model.stats = TokenStats()
        logits[mode, limit] = model.forward(tokens, model.new_cache())
        computed[mode, limit] = model.stats.neurons_active / model.stats.neurons_total
    assert len(own_up) == model.spec.n_layers  # the long block took its tokens' up products in every layer, once
    assert computed[FFNMode.SPARSE, len(tokens)] == computed[FFNMode.SPARSE, len(tokens) + 1] < 0.5, computed
    assert computed[FFNMode.DENSE, len(tokens) + 1] == 1.0
    for ours in logits.values():
        assert np.abs(ours - theirs).max() / np.abs(theirs).max() < 1e-5


def test_the_gate_misses_no_firing_neuron_where_predictors_do(predicted_file):
    """The bench's quality pass (every neuron computed beside the chosen ones): recall 1 for the gate."""
    tokens = np.arange(5, 45, 2)
    recall = {}
    for choice in ("gate", "predictor"):
        selection = decode_agreement(load_runtime_model(predicted_file, neuron_choice=choice), tokens, 8, 12).selection
        recall[choice] = selection["recall"]
    assert recall["gate"] == 1.0 and recall["predictor"] < 0.9, recall


def _recorded(path, tmp_path, computed: list[float], firing: float):
    """A copy of ``path`` recording that its predictors compute ``computed`` (per layer) and its neurons fire with
    probability ``firing`` each."""
    copy = tmp_path / path.name
    copy.write_bytes(path.read_bytes())
    changes = {PREDICTOR_COMPUTED_KEY: (computed, V.ARRAY, V.FLOAT32)}
    changes |= {neuron_frequency_key(i): ([firing] * D_FF, V.ARRAY, V.FLOAT32) for i in range(N_LAYERS)}
    rewrite_gguf(copy, changes)
    return copy


def test_auto_lets_the_gate_choose_where_it_reads_fewer_bytes(predicted_file, tmp_path):
    """Firing 10%: the gate reads 1/3 + 2/3 * 0.1 = 40% of the FFN's bytes; a predictor computing 90% of the
    neurons reads more, one computing 5% less (its own bytes are small at hidden size 8)."""
    path = _recorded(predicted_file, tmp_path, [0.9, 0.05], firing=0.1)
    model = load_runtime_model(path)
    assert [layer.dense.thresholds is GATE_CHOOSES for layer in model.layers] == [True, False]
    model.mode = FFNMode.SPARSE
    report = "\n".join(model.execution_report())
    assert "the firing neurons from the whole gate (exact)" in report
    assert "predicted (predictor hidden size 8)" in report
    by_predictors = load_runtime_model(path, neuron_choice="predictor")
    assert [layer.dense.thresholds for layer in by_predictors.layers] == [None] * 2
    # without the shares recorded, the predictors choose
    assert all(layer.dense.thresholds is None for layer in load_runtime_model(predicted_file).layers)


def test_the_gate_is_refused_where_it_would_not_be_exact(predicted_file, silu_model, tmp_path):
    silu = convert(str(silu_model), tmp_path / "silu.gguf", "f32", dense=True, progress=False)[0]
    with pytest.raises(PitoolsError, match="swiglu FFN, not ReGLU or dReLU"):
        load_runtime_model(silu, neuron_choice="gate")
    assert all(layer.dense.thresholds is None for layer in load_runtime_model(silu).layers)  # auto: no choice
    fails("run", predicted_file, "-n", "1", "--neuron-choice", "gate", "--ram", "100MB", match="RAM budget",
          names=predicted_file)
    fails("perplexity", silu_model, "--neuron-choice", "gate", match="--neuron-choice are for GGUF files")


def test_the_report_says_how_a_prompt_computes_on_the_numpy_reference(predicted_file):
    """No ``kernels.batched`` there: a prompt computes every neuron's gate and up, then the gate's choice."""
    model = load_runtime_model(predicted_file, neuron_choice="gate")
    model.mode = FFNMode.SPARSE
    kernels.use_reference("tests/test_gate_choice.py")
    try:
        report = "\n".join(model.execution_report())
    finally:
        kernels.use_reference(None)
    assert "prompts (blocks of tokens): general path | sparse FFN: every neuron's gate and up, then the gate's choice" \
        in report, report
