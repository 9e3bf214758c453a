"""A sparse prompt computes, for each token, only the neurons its predictor selected (kernels.batched):
the same logits as the reference engine's predicted path, as the token-by-token path, and, layer by layer,
as the NumPy products with the selection applied as a mask."""

from __future__ import annotations

import numpy as np
import pytest
from gguf_fixtures import make_model, random_predictors, relative_error, save_predictors

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.conversion.convert import convert
from powerinfer_tools.formats.predictor_rule import predict
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.kernels import batched
from powerinfer_tools.kernels.batched import selected_ffn
from powerinfer_tools.models import load_model
from powerinfer_tools.runtime import engine
from powerinfer_tools.runtime.loader import load_runtime_model

CONFIG = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=128)
PROMPT = np.random.default_rng(7).integers(1, 400, 48)  # more tokens than the decoding kernels take at once


@pytest.fixture(scope="module", params=["reglu", "drelu"])
def converted(request, tmp_path_factory):
    """(checkpoint folder, predictor layers, {outtype: PowerInfer GGUF path}) for a ReGLU and a dReLU LLaMA."""
    root = tmp_path_factory.mktemp(request.param)
    make_model(root / "model", "llama", hidden_act="relu", build_kwargs=dict(drelu=request.param == "drelu"), **CONFIG)
    spec = load_model(Checkpoint(root / "model")).spec
    predictors = random_predictors(spec.n_layers, spec.d_model, spec.d_ff, hidden=12, seed=5)
    save_predictors(root / "pred", predictors)
    files = {outtype: convert(str(root / "model"), root / f"m.{outtype}.gguf", outtype=outtype,
                              predictors=root / "pred", progress=False)[0] for outtype in ("f32", "q4_0")}
    return root / "model", predictors, files


def sparse_model(path):
    model = load_runtime_model(path)
    model.mode = FFNMode.SPARSE
    return model


@pytest.mark.parametrize("limit", [1.01, 0.0], ids=["own neurons", "union"])
def test_prompt_equals_the_reference_engines_predicted_path(converted, monkeypatch, limit):
    """Both block paths (``engine.OWN_NEURONS_DENSITY`` chooses by the share of neurons chosen)."""
    monkeypatch.setattr(engine, "OWN_NEURONS_DENSITY", limit)
    calls = []
    monkeypatch.setattr(batched, "selected_ffn", lambda *args: calls.append(1) or selected_ffn(*args))
    folder, predictors, files = converted
    reference = load_model(Checkpoint(folder), np.float64)
    reference.neuron_selector = lambda layer, residual, fired: predict(*predictors[layer], residual)
    model = sparse_model(files["f32"])
    logits = model.forward(PROMPT, model.new_cache())
    assert relative_error(logits, reference.forward(PROMPT, reference.new_cache())) < 1e-4
    assert 0.2 < model.stats.neurons_active / model.stats.neurons_total < 0.8  # a real selection per token
    assert bool(calls) == (limit > 1)


def test_prompt_equals_token_by_token_decoding(converted):
    # f32: in a quantized file the predictor's q8_0 rounding of its input differs between the two paths,
    # and with these random predictors enough scores sit at the threshold to flip a few selections.
    _, _, files = converted
    model = sparse_model(files["f32"])
    prompt = model.forward(PROMPT, model.new_cache())
    caches = model.new_cache()
    stepwise = np.concatenate([model.forward(PROMPT[i : i + 1], caches) for i in range(len(PROMPT))])
    assert relative_error(prompt, stepwise) < 1e-5


@pytest.mark.parametrize("outtype, tolerance", [("f32", 1e-5), ("q4_0", 2e-2)])
def test_each_token_gets_exactly_its_own_neurons(converted, outtype, tolerance):
    _, _, files = converted
    model = sparse_model(files[outtype])
    layer = model.layers[1]
    p = layer.partitions[0]
    assert batched.handles(p.gate, p.up, p.down_t)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, model.spec.d_model)).astype(np.float32)
    mask = rng.random((40, layer.d_ff)) < 0.15
    mask[5] = False  # a token that selected nothing gets nothing
    active = np.flatnonzero(mask.any(axis=0))
    expected = p.compute(model.spec.ffn, x, active, mask[:, active].astype(np.float32))  # NumPy, masked
    got = batched.selected_ffn(model.spec.ffn, p.gate, p.up, p.down_t, p.row_of[active], x, mask[:, active])
    assert relative_error(got, expected) < tolerance
    assert not got[5].any()
