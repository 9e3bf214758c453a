"""Our NumPy reference engine against Hugging Face transformers on small random models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_fixtures import relative_error
from hf_models import build, reference_logits

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.models import FFNKind, load_model, spec_from_config

LLAMA_GQA = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=101, max_position_embeddings=64)
LLAMA_MHA_ODD = dict(hidden_size=72, intermediate_size=100, num_hidden_layers=3, num_attention_heads=6,
                     num_key_value_heads=6, vocab_size=77, rms_norm_eps=1e-5, max_position_embeddings=64)
OPT_PRE = dict(hidden_size=48, ffn_dim=136, num_hidden_layers=2, num_attention_heads=4, vocab_size=90,
               max_position_embeddings=64, word_embed_proj_dim=48, pad_token_id=1)
OPT_POST_PROJ = dict(hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=83,
                     max_position_embeddings=64, word_embed_proj_dim=32, do_layer_norm_before=False,
                     pad_token_id=1)
# Gemma 3: 7 layers (the 6th global, the others sliding over 4 keys), head_dim apart from d_model / heads, a
# query scaling apart from head_dim, and RoPE bases small enough that both matter over 13 tokens.
GEMMA3 = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, vocab_size=97, max_position_embeddings=64, sliding_window=4, query_pre_attn_scalar=24,
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 500.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}})
MIXTRAL_GQA = dict(LLAMA_GQA, num_local_experts=3, num_experts_per_tok=2, sliding_window=None)
MIXTRAL_MHA_ODD = dict(LLAMA_MHA_ODD, num_local_experts=5, num_experts_per_tok=1, sliding_window=None)

CASES = {
    "llama-reglu-gqa-tied": ("llama", dict(LLAMA_GQA, hidden_act="relu", tie_word_embeddings=True), {}),
    "llama-reglu-mha-odd-untied": ("llama", dict(LLAMA_MHA_ODD, hidden_act="relu"), {}),
    "llama-swiglu-gqa": ("llama", dict(LLAMA_GQA, hidden_act="silu", rope_theta=500.0), {}),
    "llama-drelu": ("llama", dict(LLAMA_GQA, hidden_act="relu"), dict(drelu=True)),
    "llama-reglu-bias": ("llama", dict(LLAMA_MHA_ODD, hidden_act="relu", attention_bias=True, mlp_bias=True), {}),
    "mistral-swiglu-window": ("mistral", dict(LLAMA_GQA, hidden_act="silu", sliding_window=5), {}),
    "mistral-reglu": ("mistral", dict(LLAMA_MHA_ODD, hidden_act="relu", sliding_window=None), {}),
    "bamboo-drelu": ("mistral", dict(LLAMA_GQA, hidden_act="relu", sliding_window=None),
                     dict(drelu=True, saved_model_type="bamboo")),
    "mixtral-swiglu-gqa-3x2": ("mixtral", dict(MIXTRAL_GQA, hidden_act="silu"), {}),
    "mixtral-reglu-odd-5x1": ("mixtral", dict(MIXTRAL_MHA_ODD, hidden_act="relu"), {}),
    "mixtral-drelu-4x4": ("mixtral", dict(MIXTRAL_GQA, hidden_act="relu", num_local_experts=4, num_experts_per_tok=4),
                          dict(drelu=True)),
    "turbosparse-mixtral-drelu-4x2": ("mixtral", dict(MIXTRAL_GQA, hidden_act="relu", num_local_experts=4),
                                      dict(drelu=True, saved_model_type="turbosparse_mixtral")),
    # Qwen2: biases on q/k/v (none on o_proj); tied and untied heads
    "qwen2-swiglu-gqa-tied": ("qwen2", dict(LLAMA_GQA, hidden_act="silu", tie_word_embeddings=True, rope_theta=500.0),
                              {}),
    "qwen2-swiglu-mha-odd-untied": ("qwen2", dict(LLAMA_MHA_ODD, hidden_act="silu"), {}),
    "qwen2-reglu-gqa": ("qwen2", dict(LLAMA_GQA, hidden_act="relu"), {}),
    "gemma3-tied": ("gemma3", GEMMA3, {}),
    "gemma3-untied-mha": ("gemma3", dict(GEMMA3, num_key_value_heads=4, tie_word_embeddings=False), {}),
    "opt-pre-ln": ("opt", OPT_PRE, {}),
    "opt-post-ln-projections": ("opt", OPT_POST_PROJ, {}),
    "opt-untied": ("opt", dict(OPT_PRE, tie_word_embeddings=False), {}),
}
EXPECTED_FFN = {"mixtral-drelu-4x4": FFNKind.DRELU, "turbosparse-mixtral-drelu-4x2": FFNKind.DRELU,
                "mixtral-reglu-odd-5x1": FFNKind.REGLU, "llama-drelu": FFNKind.DRELU, "bamboo-drelu": FFNKind.DRELU, "llama-swiglu-gqa": FFNKind.SWIGLU,
                "mistral-swiglu-window": FFNKind.SWIGLU, "opt-pre-ln": FFNKind.RELU,
                "qwen2-swiglu-gqa-tied": FFNKind.SWIGLU, "qwen2-reglu-gqa": FFNKind.REGLU,
                "gemma3-tied": FFNKind.GEGLU}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    family, overrides, extra = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    torch_model = build(folder, family, seed=len(request.param), config_overrides=overrides, **extra)
    vocab = overrides["vocab_size"]
    tokens = np.random.default_rng(0).integers(0, vocab, size=13)
    return request.param, folder, reference_logits(torch_model, tokens), tokens


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_full_prompt_logits_match_transformers(case, dtype):
    name, folder, ref, tokens = case
    model = load_model(Checkpoint(folder), dtype)
    logits = model.forward(tokens, model.new_cache())
    assert logits.dtype == dtype
    assert relative_error(logits, ref) < 1e-4, name
    if name in EXPECTED_FFN:
        assert model.spec.ffn is EXPECTED_FFN[name]


def test_kv_cache_steps_match_transformers(case):
    """Prompt in one block, then one token at a time: every position's logits match."""
    name, folder, ref, tokens = case
    model = load_model(Checkpoint(folder), np.float32)
    cache = model.new_cache()
    steps = [model.forward(tokens[:6], cache)] + [model.forward(tokens[i : i + 1], cache) for i in range(6, len(tokens))]
    assert cache.length == len(tokens)
    assert relative_error(np.concatenate(steps), ref) < 1e-4, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_and_sharded_checkpoints(tmp_path, dtype):
    torch_model = build(tmp_path, "llama", config_overrides=dict(LLAMA_GQA, hidden_act="relu"), dtype=dtype,
                        max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    tokens = np.arange(9) * 7 % LLAMA_GQA["vocab_size"]
    model = load_model(Checkpoint(tmp_path), np.float32)
    assert relative_error(model.forward(tokens, model.new_cache()), reference_logits(torch_model, tokens)) < 1e-4


def test_ffn_hook_sees_firing_neurons(case):
    name, folder, _, tokens = case
    model = load_model(Checkpoint(folder))
    seen = {}
    model.ffn_hook = lambda trace: seen.setdefault(trace.layer, []).append(trace)
    model.forward(tokens, model.new_cache())
    spec = model.spec
    assert sorted(seen) == list(range(spec.n_layers))
    traces = seen[0]
    # A mixture of experts: each routed expert sees its own tokens, each token k experts.
    assert [t.expert for t in traces] == (sorted({t.expert for t in traces}) if spec.moe else [None])
    assert sum(len(t.activated) for t in traces) == len(tokens) * max(spec.n_experts_used, 1)
    for trace in traces:
        assert trace.activated.shape[1] == spec.d_ff
        assert trace.ffn_input.shape == (len(trace.activated), spec.d_model) == trace.residual.shape
    fired = np.concatenate([t.fired for t in traces]).mean()
    if spec.ffn.sparse:
        assert 0 < fired < 1  # random ReLU-family weights fire about half the neurons
    elif spec.ffn is FFNKind.GEGLU:
        assert fired > 0.9  # tanh GELU rounds to exactly 0 far below zero (tanh -> -1 in float32)
    else:
        assert fired == 1.0


def test_unsupported_architecture_and_activation_are_named():
    from powerinfer_tools.errors import PitoolsError

    with pytest.raises(PitoolsError, match="'gpt2' is not supported.*llama.*mistral.*opt"):
        spec_from_config({"model_type": "gpt2"})
    with pytest.raises(PitoolsError, match="hidden_act='gelu'.*supported: relu, drelu, silu"):
        spec_from_config(dict(LLAMA_GQA, model_type="llama", hidden_act="gelu"))
    with pytest.raises(PitoolsError, match="lacks the field 'intermediate_size'"):
        spec_from_config({"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1})


QWEN2_CONFIG = dict(LLAMA_GQA, model_type="qwen2", hidden_act="silu", max_position_embeddings=4096)


def test_qwen2_spec_has_attention_biases_and_no_sliding_window():
    spec = spec_from_config(dict(QWEN2_CONFIG, use_sliding_window=False, sliding_window=1024))
    assert spec.architecture.name == "qwen2" and spec.attention_bias and spec.sliding_window is None
    # A window spanning the whole context changes nothing: accepted, not applied.
    assert spec_from_config(dict(QWEN2_CONFIG, use_sliding_window=True, sliding_window=4096)).sliding_window is None
    # Qwen2 defaults use_sliding_window to false (LLaMA's reading would apply the window).
    assert spec_from_config(dict(QWEN2_CONFIG, sliding_window=1024)).sliding_window is None


def test_qwen2_sliding_window_attention_is_refused():
    from powerinfer_tools.errors import PitoolsError

    with pytest.raises(PitoolsError, match="sliding-window attention.*sliding_window=1024 < max_position_embeddings=4096"):
        spec_from_config(dict(QWEN2_CONFIG, use_sliding_window=True, sliding_window=1024))


def test_gemma3_spec_reads_both_config_layouts():
    """transformers v5's per-layer-type rope_parameters and v4's rope_theta / rope_local_base_freq /
    sliding_window_pattern read the same; layer types that follow no every-Nth pattern are refused."""
    from powerinfer_tools.errors import PitoolsError

    v5 = spec_from_config(dict(GEMMA3, model_type="gemma3_text"))
    v4 = dict(GEMMA3, model_type="gemma3_text", rope_theta=500.0, rope_local_base_freq=50.0, sliding_window_pattern=6)
    del v4["rope_parameters"]
    assert spec_from_config(v4) == v5
    assert [v5.layer_window(i) for i in range(7)] == [4] * 5 + [None, 4]
    assert [v5.layer_rope(i)[0] for i in range(7)] == [50.0] * 5 + [500.0, 50.0]
    with pytest.raises(PitoolsError, match="every 2th layer"):
        spec_from_config(dict(GEMMA3, model_type="gemma3_text", layer_types=["sliding_attention", "full_attention"] * 3
                              + ["full_attention"]))


def test_tracing_shows_every_ffn_computes_no_logits_and_restores_the_model():
    """What profiling and calibration run the reference engine under (``interfaces.tracing``)."""
    from powerinfer_tools.bundled import BUNDLED_MODEL
    from powerinfer_tools.interfaces import tracing

    model = load_model(Checkpoint(BUNDLED_MODEL))
    tokens = np.array([1, 2, 3, 4])
    dense = model.forward(tokens, model.new_cache())
    seen = []
    with tracing(model, lambda trace: seen.append(trace.layer)):
        assert model.forward(tokens, model.new_cache()).shape == (4, 0)
    assert seen == list(range(model.spec.n_layers))
    assert model.ffn_hook is None and model.activation_thresholds is None
    np.testing.assert_array_equal(model.forward(tokens, model.new_cache()), dense)
