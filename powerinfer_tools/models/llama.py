"""LLaMA family: ReluLLaMA and ProSparse (ReGLU), plain SiLU LLaMA, and dReLU variants."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checkpoint import Checkpoint
from ..errors import PitoolsError
from .base import DecoderModel, require, rope_settings
from .layers import (
    FFNWeights,
    KVCache,
    apply_rope,
    attention,
    feed_forward,
    linear,
    rms_norm,
    rope_tables,
)
from .spec import FFNKind, ModelSpec, NormKind

# hidden_act values and the FFN they mean in a gated (gate/up/down) MLP.
GATED_ACTIVATIONS = {"relu": FFNKind.REGLU, "drelu": FFNKind.DRELU, "silu": FFNKind.SWIGLU}


def gated_ffn_kind(config: dict, architecture: str) -> FFNKind:
    act = config.get("hidden_act", "silu")
    if act not in GATED_ACTIVATIONS:
        supported = ", ".join(GATED_ACTIVATIONS)
        raise PitoolsError(f"{architecture} models with hidden_act={act!r} are not supported (supported: {supported})")
    return GATED_ACTIVATIONS[act]


def spec_from_config(config: dict, architecture: str = "llama", ffn: FFNKind | None = None) -> ModelSpec:
    d_model = require(config, "hidden_size", architecture)
    n_heads = require(config, "num_attention_heads", architecture)
    theta, scaling = rope_settings(config)
    return ModelSpec(
        architecture=architecture,
        n_layers=require(config, "num_hidden_layers", architecture),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        head_dim=config.get("head_dim") or d_model // n_heads,
        d_ff=require(config, "intermediate_size", architecture),
        vocab_size=require(config, "vocab_size", architecture),
        max_positions=config.get("max_position_embeddings", 2048),
        norm=NormKind.RMS,
        norm_eps=config.get("rms_norm_eps", 1e-6),
        ffn=ffn or gated_ffn_kind(config, architecture),
        tied_embeddings=config.get("tie_word_embeddings", False),
        rope_theta=theta,
        rope_scaling_factor=scaling,
        sliding_window=config.get("sliding_window") if config.get("use_sliding_window", True) else None,
        attention_bias=config.get("attention_bias", False),
        ffn_bias=config.get("mlp_bias", False),
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=config.get("eos_token_id"),
    )


@dataclass
class Block:
    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    bq: np.ndarray | None
    bk: np.ndarray | None
    bv: np.ndarray | None
    bo: np.ndarray | None
    ffn_norm: np.ndarray
    ffn: FFNWeights


class Model(DecoderModel):
    def __init__(self, spec: ModelSpec, embed: np.ndarray, blocks: list[Block], norm: np.ndarray, lm_head: np.ndarray):
        super().__init__()
        self.spec, self.embed, self.blocks, self.norm, self.lm_head = spec, embed, blocks, norm, lm_head
        self.dtype = embed.dtype

    @classmethod
    def from_checkpoint(cls, spec: ModelSpec, checkpoint: Checkpoint, dtype=np.float32) -> "Model":
        def get(name: str) -> np.ndarray:
            return np.ascontiguousarray(checkpoint.tensor(name, dtype))

        def maybe(name: str) -> np.ndarray | None:
            return get(name) if name in checkpoint else None

        blocks = []
        for i in range(spec.n_layers):
            p = f"model.layers.{i}."
            blocks.append(
                Block(
                    attn_norm=get(p + "input_layernorm.weight"),
                    wq=get(p + "self_attn.q_proj.weight"),
                    wk=get(p + "self_attn.k_proj.weight"),
                    wv=get(p + "self_attn.v_proj.weight"),
                    wo=get(p + "self_attn.o_proj.weight"),
                    bq=maybe(p + "self_attn.q_proj.bias"),
                    bk=maybe(p + "self_attn.k_proj.bias"),
                    bv=maybe(p + "self_attn.v_proj.bias"),
                    bo=maybe(p + "self_attn.o_proj.bias"),
                    ffn_norm=get(p + "post_attention_layernorm.weight"),
                    ffn=FFNWeights(
                        gate=get(p + "mlp.gate_proj.weight"),
                        up=get(p + "mlp.up_proj.weight"),
                        down=get(p + "mlp.down_proj.weight"),
                        gate_bias=maybe(p + "mlp.gate_proj.bias"),
                        up_bias=maybe(p + "mlp.up_proj.bias"),
                        down_bias=maybe(p + "mlp.down_proj.bias"),
                    ),
                )
            )
        embed = get("model.embed_tokens.weight")
        lm_head = embed if spec.tied_embeddings or "lm_head.weight" not in checkpoint else get("lm_head.weight")
        return cls(spec, embed, blocks, get("model.norm.weight"), lm_head)

    def forward(self, tokens: np.ndarray, cache: KVCache) -> np.ndarray:
        s = self.spec
        start = cache.length
        positions = np.arange(start, start + len(tokens))
        cos, sin = rope_tables(positions, s.head_dim, s.rope_theta, s.rope_scaling_factor, self.dtype)
        x = self.embed[tokens]
        for i, b in enumerate(self.blocks):
            h = rms_norm(x, b.attn_norm, s.norm_eps)
            q = linear(h, b.wq, b.bq).reshape(len(tokens), s.n_heads, s.head_dim)
            k = linear(h, b.wk, b.bk).reshape(len(tokens), s.n_kv_heads, s.head_dim)
            v = linear(h, b.wv, b.bv).reshape(len(tokens), s.n_kv_heads, s.head_dim)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            keys, values = cache.store(i, k, v)
            x = x + linear(attention(q, keys, values, start, s.sliding_window), b.wo, b.bo)
            h = rms_norm(x, b.ffn_norm, s.norm_eps)
            x = x + feed_forward(s.ffn, b.ffn, h, i, self.ffn_hook, self.neuron_selector, residual=x)
        cache.advance(len(tokens))
        return rms_norm(x, self.norm, s.norm_eps) @ self.lm_head.T
