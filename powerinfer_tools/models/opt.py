"""OPT: ReLU FFN with biases, learned positions (offset 2), pre- or post-LayerNorm blocks.

OPT-350m is the odd one: post-LayerNorm blocks (``do_layer_norm_before: false``)
and 512-wide embeddings projected in and out of the 1024-wide decoder
(``word_embed_proj_dim``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checkpoint import Checkpoint
from ..errors import PitoolsError
from .base import DecoderModel, require
from .layers import FFNWeights, KVCache, attention, feed_forward, layer_norm, linear
from .spec import FFNKind, ModelSpec, NormKind

POSITION_OFFSET = 2  # OPT reserves the first two rows of its position table


def spec_from_config(config: dict) -> ModelSpec:
    act = config.get("activation_function", "relu")
    if act != "relu":
        raise PitoolsError(f"opt models with activation_function={act!r} are not supported (supported: relu)")
    d_model = require(config, "hidden_size", "opt")
    n_heads = require(config, "num_attention_heads", "opt")
    embed_dim = config.get("word_embed_proj_dim") or d_model
    pre_norm = config.get("do_layer_norm_before", True)
    bias = config.get("enable_bias", True)
    if not config.get("layer_norm_elementwise_affine", True):
        raise PitoolsError("opt models without LayerNorm weights (layer_norm_elementwise_affine=false) are not supported")
    return ModelSpec(
        architecture="opt",
        n_layers=require(config, "num_hidden_layers", "opt"),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_heads,
        head_dim=d_model // n_heads,
        d_ff=require(config, "ffn_dim", "opt"),
        vocab_size=require(config, "vocab_size", "opt"),
        max_positions=config.get("max_position_embeddings", 2048),
        norm=NormKind.LAYER,
        norm_eps=1e-5,  # torch.nn.LayerNorm's default, which OPT uses
        ffn=FFNKind.RELU,
        tied_embeddings=config.get("tie_word_embeddings", True),
        attention_bias=bias,
        ffn_bias=bias,
        pre_norm=pre_norm,
        final_norm=pre_norm and not config.get("_remove_final_layer_norm", False),
        embed_dim=embed_dim if embed_dim != d_model else None,
        position_offset=POSITION_OFFSET,
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=config.get("eos_token_id"),
    )


@dataclass
class Norm:
    weight: np.ndarray
    bias: np.ndarray


@dataclass
class Block:
    attn_norm: Norm
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    bq: np.ndarray | None
    bk: np.ndarray | None
    bv: np.ndarray | None
    bo: np.ndarray | None
    ffn_norm: Norm
    ffn: FFNWeights


class Model(DecoderModel):
    def __init__(self, spec: ModelSpec, tensors: dict, blocks: list[Block]):
        super().__init__()
        self.spec, self.blocks = spec, blocks
        self.embed = tensors["embed"]
        self.positions = tensors["positions"]
        self.project_in = tensors.get("project_in")
        self.project_out = tensors.get("project_out")
        self.final_norm = tensors.get("final_norm")
        self.lm_head = tensors["lm_head"]
        self.dtype = self.embed.dtype

    @classmethod
    def from_checkpoint(cls, spec: ModelSpec, checkpoint: Checkpoint, dtype=np.float32) -> "Model":
        def get(name: str) -> np.ndarray:
            return np.ascontiguousarray(checkpoint.tensor(name, dtype))

        def maybe(name: str) -> np.ndarray | None:
            return get(name) if name in checkpoint else None

        def norm(prefix: str) -> Norm:
            return Norm(get(prefix + ".weight"), get(prefix + ".bias"))

        d = "model.decoder."
        blocks = []
        for i in range(spec.n_layers):
            p = f"{d}layers.{i}."
            blocks.append(
                Block(
                    attn_norm=norm(p + "self_attn_layer_norm"),
                    wq=get(p + "self_attn.q_proj.weight"),
                    wk=get(p + "self_attn.k_proj.weight"),
                    wv=get(p + "self_attn.v_proj.weight"),
                    wo=get(p + "self_attn.out_proj.weight"),
                    bq=maybe(p + "self_attn.q_proj.bias"),
                    bk=maybe(p + "self_attn.k_proj.bias"),
                    bv=maybe(p + "self_attn.v_proj.bias"),
                    bo=maybe(p + "self_attn.out_proj.bias"),
                    ffn_norm=norm(p + "final_layer_norm"),
                    ffn=FFNWeights(
                        up=get(p + "fc1.weight"),
                        down=get(p + "fc2.weight"),
                        up_bias=maybe(p + "fc1.bias"),
                        down_bias=maybe(p + "fc2.bias"),
                    ),
                )
            )
        embed = get(d + "embed_tokens.weight")
        tensors = {
            "embed": embed,
            "positions": get(d + "embed_positions.weight"),
            "lm_head": embed if spec.tied_embeddings or "lm_head.weight" not in checkpoint else get("lm_head.weight"),
        }
        if spec.embed_dim is not None:
            tensors["project_in"] = get(d + "project_in.weight")
            tensors["project_out"] = get(d + "project_out.weight")
        if spec.final_norm:
            tensors["final_norm"] = norm(d + "final_layer_norm")
        return cls(spec, tensors, blocks)

    def _attention(self, b: Block, h: np.ndarray, i: int, cache: KVCache, start: int) -> np.ndarray:
        s = self.spec
        n = len(h)
        q = linear(h, b.wq, b.bq).reshape(n, s.n_heads, s.head_dim)
        k = linear(h, b.wk, b.bk).reshape(n, s.n_kv_heads, s.head_dim)
        v = linear(h, b.wv, b.bv).reshape(n, s.n_kv_heads, s.head_dim)
        keys, values = cache.store(i, k, v)
        return linear(attention(q, keys, values, start), b.wo, b.bo)

    def forward(self, tokens: np.ndarray, cache: KVCache) -> np.ndarray:
        s = self.spec
        start = cache.length
        x = self.embed[tokens]
        if self.project_in is not None:
            x = linear(x, self.project_in)
        x = x + self.positions[start + s.position_offset : start + s.position_offset + len(tokens)]

        def ln(norm: Norm, v: np.ndarray) -> np.ndarray:
            return layer_norm(v, norm.weight, norm.bias, s.norm_eps)

        for i, b in enumerate(self.blocks):
            if s.pre_norm:
                x = x + self._attention(b, ln(b.attn_norm, x), i, cache, start)
                x = x + feed_forward(s.ffn, b.ffn, ln(b.ffn_norm, x), i, self.ffn_hook, self.neuron_selector,
                                     residual=x)
            else:
                x = ln(b.attn_norm, x + self._attention(b, x, i, cache, start))
                x = ln(b.ffn_norm, x + feed_forward(s.ffn, b.ffn, x, i, self.ffn_hook, self.neuron_selector))
        cache.advance(len(tokens))
        if self.final_norm is not None:
            x = ln(self.final_norm, x)
        if self.project_out is not None:
            x = linear(x, self.project_out)
        return x @ self.lm_head.T
