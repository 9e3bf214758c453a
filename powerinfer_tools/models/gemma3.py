"""Gemma 3 (text; transformers' ``Gemma3ForCausalLM``, llama.cpp's ``gemma3``).

LLaMA's grouped-query attention and gated FFN with Gemma's changes: the FFN is GeGLU (tanh GELU on the
gate); q and k are RMS-normed per head before RoPE; attention and FFN outputs are normed again before
they join the residual stream; every RMSNorm scales by ``1 + w``; token embeddings are multiplied by
sqrt(d_model); scores are scaled by ``query_pre_attn_scalar``, not the head size; and five layers in
six attend within a sliding window, rotating with their own (local) RoPE base. The layer math is
``models/layers.py``'s; the table (``formats.tensor_table.GEMMA3``) names the further norms.
"""

from __future__ import annotations

from functools import partial

import numpy as np
from gguf import MODEL_TENSOR as T

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.model_spec import FFNKind, ModelSpec, NormKind
from powerinfer_tools.formats.tensor_table import GEMMA3
from powerinfer_tools.models import llama
from powerinfer_tools.models.base import (
    CheckpointWeights,
    Stages,
    load_block,
    optional,
    require,
    rope_settings,
    token_id,
)
from powerinfer_tools.models.layers import (
    KVCache,
    apply_rope,
    embedding_scale,
    rms_norm,
    rope_tables,
)

ARCHITECTURE = "gemma3"
MODEL_TYPE = "gemma3_text"
ACTIVATION = "gelu_pytorch_tanh"
SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types
CONFIG_KEYS = {**llama.CONFIG_KEYS, "sliding_window_pattern": "layer_types", "rope_local_theta": "rope_local_base_freq"}
_DEFAULT_PATTERN = 6  # transformers' Gemma3TextConfig: every 6th layer global


def spec_from_config(config: dict) -> ModelSpec:
    activation = config.get("hidden_activation", ACTIVATION)
    if activation != ACTIVATION:
        raise PitoolsError(f"gemma3 models with hidden_activation={activation!r} are not supported "
                           f"(supported: {ACTIVATION})")
    for capping in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(capping) is not None:
            raise PitoolsError(f"gemma3 models with {capping} are not supported")
    full, local = _rope_parameters(config)
    theta, scaling = rope_settings(full)
    n_heads = require(config, "num_attention_heads", ARCHITECTURE)
    return ModelSpec(
        architecture=ARCHITECTURE,
        n_layers=require(config, "num_hidden_layers", ARCHITECTURE),
        d_model=require(config, "hidden_size", ARCHITECTURE),
        n_heads=n_heads,
        n_kv_heads=optional(config, "num_key_value_heads", n_heads),
        head_dim=optional(config, "head_dim", 256),
        d_ff=require(config, "intermediate_size", ARCHITECTURE),
        vocab_size=require(config, "vocab_size", ARCHITECTURE),
        max_positions=optional(config, "max_position_embeddings", 131072),
        norm=NormKind.RMS,
        norm_eps=optional(config, "rms_norm_eps", 1e-6),
        ffn=FFNKind.GEGLU,
        tied_embeddings=optional(config, "tie_word_embeddings", True),
        rope_theta=theta,
        rope_scaling_factor=scaling,
        sliding_window=optional(config, "sliding_window", 4096),
        sliding_window_pattern=_sliding_window_pattern(config),
        rope_local_theta=rope_settings(local)[0],
        query_pre_attn_scalar=optional(config, "query_pre_attn_scalar", 256),
        bos_token_id=token_id(config, "bos_token_id"),
        eos_token_id=token_id(config, "eos_token_id"),
    )


def _rope_parameters(config: dict) -> tuple[dict, dict]:
    """(global, local) rope settings, each a config ``rope_settings`` reads: transformers v5 keeps one
    ``rope_parameters`` per layer type; v4 ``rope_theta``/``rope_scaling`` for the global layers and
    ``rope_local_base_freq`` for the sliding ones (which are never scaled)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and FULL in params:
        return {"rope_parameters": params[FULL]}, {"rope_parameters": params.get(SLIDING) or {}}
    return config, {"rope_theta": optional(config, "rope_local_base_freq", 10000.0)}


def _sliding_window_pattern(config: dict) -> int:
    """N where every Nth layer attends globally: from ``layer_types``, which must follow one such pattern."""
    layer_types = config.get("layer_types")
    if layer_types is None:
        return optional(config, "sliding_window_pattern", _DEFAULT_PATTERN)
    if not isinstance(layer_types, list) or FULL not in layer_types:
        raise PitoolsError(f"layer_types must list {FULL!r} layers, not {layer_types!r:.60}")
    pattern = layer_types.index(FULL) + 1
    expected = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(len(layer_types))]
    if layer_types != expected:
        raise PitoolsError(f"layer_types must have every {pattern}th layer {FULL!r} and the others {SLIDING!r} "
                           "(the only arrangement supported)")
    return pattern


def config_from_spec(spec: ModelSpec) -> dict:
    """The config.json (transformers v4's keys, which v5 reads too) that reads back as ``spec``."""
    plain = ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "max_positions", "norm_eps", "tied_embeddings")
    config = {llama.CONFIG_KEYS[field]: getattr(spec, field) for field in plain}
    layer_types = [SLIDING if spec.slides(i) else FULL for i in range(spec.n_layers)]
    config.update(model_type=MODEL_TYPE, head_dim=spec.head_dim, vocab_size=spec.vocab_size, hidden_activation=ACTIVATION,
                  rope_theta=spec.rope_theta, rope_local_base_freq=spec.rope_local_theta, layer_types=layer_types,
                  sliding_window=spec.sliding_window, query_pre_attn_scalar=spec.query_pre_attn_scalar,
                  bos_token_id=spec.bos_token_id, eos_token_id=spec.eos_token_id)
    if spec.rope_scaling_factor != 1.0:
        config["rope_scaling"] = {"rope_type": "linear", "factor": spec.rope_scaling_factor}
    return config


class Model(llama.Model):
    @classmethod
    def from_checkpoint(cls, spec: ModelSpec, checkpoint: Checkpoint, dtype=np.float32,
                        layers: range | None = None) -> Model:
        w = CheckpointWeights(checkpoint, dtype, layers)
        d, vocab, hf = spec.d_model, spec.vocab_size, GEMMA3.hf_name
        widths = {T.ATTN_Q_NORM: spec.head_dim, T.ATTN_K_NORM: spec.head_dim}

        def norm(tensor: T, layer: int | None = None) -> np.ndarray:  # the (1 + w) of every Gemma RMSNorm
            return w.get(hf(tensor, layer), widths.get(tensor, d)) + dtype(GEMMA3.norm_offset)

        blocks = w.blocks(spec, lambda i: load_block(w, GEMMA3, spec, i, norm))
        embed = w.get(hf(T.TOKEN_EMBD), vocab, d)
        untied = not spec.tied_embeddings and hf(T.OUTPUT) in checkpoint
        return cls(spec, embed, blocks, norm(T.OUTPUT_NORM), w.get(hf(T.OUTPUT), vocab, d) if untied else embed)

    def stages(self, tokens: np.ndarray, cache: KVCache) -> Stages:
        s = self.spec
        start = cache.length
        positions = np.arange(start, start + len(tokens))
        rotations = {}  # (theta, scaling) -> its rotation; two per model, global and local
        for rope in {s.layer_rope(i) for i in range(s.n_layers)}:
            cos, sin = rope_tables(positions, s.head_dim, *rope, self.dtype)
            rotations[rope] = partial(apply_rope, cos=cos, sin=sin)

        def norm(weight: np.ndarray, v: np.ndarray) -> np.ndarray:
            return rms_norm(v, weight, s.norm_eps)

        layers = [partial(self.layer, i, b, cache=cache, start=start, norm=norm, rotate=rotations[s.layer_rope(i)])
                  for i, b in enumerate(self.blocks)]
        return Stages(self.embed[tokens] * self.dtype.type(embedding_scale(s)), layers,
                      lambda x: self.head(rms_norm(x, self.norm, s.norm_eps)))
