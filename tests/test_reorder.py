"""Hot-first neuron order: permuting every FFN (and its predictor) leaves the model's output unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from hf_models import build
from powerinfer_tools.formats.predictor_rule import predict
from powerinfer_tools.formats.architecture import gguf_neuron_axis
from tiny_models import OPT, TINY_RELU_LLAMA, run_profiler

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.conversion.reorder import (
    hot_first_permutation,
    permute_ffn,
    permute_neurons,
    permute_predictor,
    profile_permutations,
)
from powerinfer_tools.models import load_model

CASES = {
    "llama-reglu-biases": ("llama", dict(TINY_RELU_LLAMA, mlp_bias=True), {}),
    "llama-drelu": ("llama", TINY_RELU_LLAMA, dict(drelu=True)),
    "opt-relu": ("opt", OPT, {}),
}


def test_hot_first_permutation_sorts_by_count_and_keeps_ties_in_order():
    perm = hot_first_permutation(np.array([3, 9, 3, 0, 9]))
    np.testing.assert_array_equal(perm, [1, 4, 0, 2, 3])


@pytest.mark.parametrize("name", sorted(CASES))
def test_permuted_model_computes_the_same_logits(name, tmp_path):
    family, config, extra = CASES[name]
    build(tmp_path, family, config_overrides=config, **extra)
    model = load_model(Checkpoint(tmp_path))
    tokens = np.random.default_rng(0).integers(0, config["vocab_size"], 24)
    before = model.forward(tokens, model.new_cache())
    rng = np.random.default_rng(1)
    for block in model.blocks:
        perm = hot_first_permutation(rng.integers(0, 1000, model.spec.d_ff))
        assert not np.array_equal(perm, np.arange(model.spec.d_ff))
        block.ffn = permute_ffn(block.ffn, perm)
    after = model.forward(tokens, model.new_cache())
    np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-4 * np.abs(before).max())


def test_profile_of_the_reordered_model_is_hot_first(tmp_path):
    build(tmp_path, "llama", config_overrides=TINY_RELU_LLAMA)
    model = load_model(Checkpoint(tmp_path))
    tokens = np.random.default_rng(2).integers(0, 256, 256)
    stats = run_profiler(model, tokens, tmp_path / "before")
    counts = stats.fire_count
    perms = list(profile_permutations(stats, model.spec.ffn_units, model.spec.d_ff).values())
    for block, perm in zip(model.blocks, perms):
        block.ffn = permute_ffn(block.ffn, perm)
    reordered = run_profiler(model, tokens, tmp_path / "after").fire_count
    for layer, perm in enumerate(perms):
        np.testing.assert_array_equal(reordered[layer], counts[layer][perm])
        assert np.all(np.diff(reordered[layer]) <= 0)


def test_permuted_predictor_selects_the_permuted_neurons():
    rng = np.random.default_rng(3)
    fc1, fc2, x = rng.standard_normal((8, 16)), rng.standard_normal((40, 8)), rng.standard_normal((5, 16))
    perm = rng.permutation(40)
    new_fc1, new_fc2 = permute_predictor(fc1, fc2, perm)
    np.testing.assert_array_equal(predict(new_fc1, new_fc2, x), predict(fc1, fc2, x)[:, perm])


def test_permuting_gguf_tensors_along_their_neuron_axes_keeps_the_ffn_output():
    rng = np.random.default_rng(4)
    d, d_ff = 6, 10
    t = {"ffn_gate.weight": rng.standard_normal((d_ff, d)), "ffn_up.weight": rng.standard_normal((d_ff, d)),
         "ffn_gate.bias": rng.standard_normal(d_ff), "ffn_up.bias": rng.standard_normal(d_ff),
         "ffn_down.weight": rng.standard_normal((d, d_ff)), "ffn_down.bias": rng.standard_normal(d),
         "attn_q.weight": rng.standard_normal((d, d))}
    t["ffn_down_t.weight"], t["ffn_down_t.bias"] = t["ffn_down.weight"].T, t["ffn_down.bias"]
    x = rng.standard_normal(d)

    def ffn(t: dict, down: np.ndarray, down_bias: np.ndarray) -> np.ndarray:
        gate = t["ffn_gate.weight"] @ x + t["ffn_gate.bias"]
        return down @ (np.maximum(gate, 0) * (t["ffn_up.weight"] @ x + t["ffn_up.bias"])) + down_bias

    perm = rng.permutation(d_ff)
    permuted = {}
    for name, tensor in t.items():
        axis = gguf_neuron_axis(f"blk.3.{name}")
        permuted[name] = tensor if axis is None else permute_neurons(tensor, perm, axis)
    assert permuted["attn_q.weight"] is t["attn_q.weight"] and permuted["ffn_down.bias"] is t["ffn_down.bias"]
    expected = ffn(t, t["ffn_down.weight"], t["ffn_down.bias"])
    np.testing.assert_allclose(ffn(permuted, permuted["ffn_down.weight"], permuted["ffn_down.bias"]), expected)
    np.testing.assert_allclose(ffn(permuted, permuted["ffn_down_t.weight"].T, permuted["ffn_down_t.bias"]), expected)
    assert gguf_neuron_axis("blk.3.fc2.weight") == 0 and gguf_neuron_axis("blk.3.fc1.weight") is None
    assert gguf_neuron_axis("token_embd.weight") is None
