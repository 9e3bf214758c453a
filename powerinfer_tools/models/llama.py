"""LLaMA family: ReluLLaMA and ProSparse (ReGLU), plain SiLU LLaMA (Llama 2, Llama 3.x with its rope scaling),
and dReLU variants; and the reference model of every rotary family.

``Model`` computes any family whose row (``ARCHITECTURE`` of its module) describes a pre-norm decoder with
rotary positions: its norms (with the row's ``norm_offset``), q/k norms and post-norms where the row has
them, per-layer windows and rotary bases (``ModelSpec.layer_window``, ``layer_rope``), fused tensors read
through the row. Mistral, Mixtral, Qwen2, Qwen3, Phi-3 and Gemma 3 use it; OPT has its own.
"""

from __future__ import annotations

from functools import partial

import numpy as np
from gguf import MODEL_TENSOR as T

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.architecture import Architecture, TensorRow, block_rows
from powerinfer_tools.formats.model_spec import FFNKind, ModelSpec, NormKind
from powerinfer_tools.formats.rope import RopeKind
from powerinfer_tools.models.base import (
    Block,
    CheckpointWeights,
    DecoderModel,
    Stages,
    load_block,
    optional,
    read_weight,
    require,
    rope_settings,
    token_id,
)
from powerinfer_tools.models.layers import KVCache, apply_rope, embedding_scale, rms_norm, rope_tables

# hidden_act values and the FFN they mean in a gated (gate/up/down) MLP.
GATED_ACTIVATIONS = {"relu": FFNKind.REGLU, "drelu": FFNKind.DRELU, "silu": FFNKind.SWIGLU}


# ModelSpec fields -> the config.json keys they come from, for error messages.
CONFIG_KEYS = {
    "n_layers": "num_hidden_layers",
    "d_model": "hidden_size",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "d_ff": "intermediate_size",
    "max_positions": "max_position_embeddings",
    "norm_eps": "rms_norm_eps",
    "ffn": "hidden_act",
    "rope_scaling": "rope_scaling",
    "rope_scaling_factor": "rope_scaling factor",
    "rope_short_factors": "rope_scaling short_factor",
    "rope_long_factors": "rope_scaling long_factor",
    "tied_embeddings": "tie_word_embeddings",
    "ffn_bias": "mlp_bias",
}


def gated_ffn_kind(config: dict, architecture: Architecture) -> FFNKind:
    act = config.get("hidden_act", "silu")
    if not isinstance(act, str) or act not in GATED_ACTIVATIONS:
        supported = ", ".join(GATED_ACTIVATIONS)
        raise PitoolsError(f"{architecture} models with hidden_act={act!r} are not supported (supported: {supported})")
    return GATED_ACTIVATIONS[act]


def head_size(config: dict) -> int | None:
    """config.json's head size: ``head_dim``, else hidden_size / num_attention_heads where those are numbers
    (ModelSpec checks them); what rotary scaling is computed for."""
    if config.get("head_dim") is not None:
        return config["head_dim"]
    d, heads = config.get("hidden_size"), config.get("num_attention_heads")
    return d // heads if isinstance(d, int) and isinstance(heads, int) and heads > 0 else None


def spec_from_config(config: dict, architecture: Architecture | None = None, ffn: FFNKind | None = None) -> ModelSpec:
    architecture = architecture or ARCHITECTURE
    n_heads = require(config, "num_attention_heads", architecture)
    theta, scaling = rope_settings(config, head_size(config))
    return ModelSpec(
        architecture=architecture,
        n_layers=require(config, "num_hidden_layers", architecture),
        d_model=require(config, "hidden_size", architecture),
        n_heads=n_heads,
        n_kv_heads=optional(config, "num_key_value_heads", n_heads),
        head_dim=config.get("head_dim"),  # None: derived
        d_ff=require(config, "intermediate_size", architecture),
        vocab_size=require(config, "vocab_size", architecture),
        max_positions=optional(config, "max_position_embeddings", 2048),
        norm=NormKind.RMS,
        norm_eps=optional(config, "rms_norm_eps", 1e-6),
        ffn=ffn or gated_ffn_kind(config, architecture),
        tied_embeddings=optional(config, "tie_word_embeddings", False),
        rope_theta=theta,
        rope_scaling=scaling,
        sliding_window=config.get("sliding_window") if config.get("use_sliding_window", True) else None,
        attention_bias=optional(config, "attention_bias", False),
        ffn_bias=optional(config, "mlp_bias", False),
        bos_token_id=token_id(config, "bos_token_id"),
        eos_token_id=token_id(config, "eos_token_id"),
    )


class Model(DecoderModel):
    """A pre-norm decoder with rotary positions, as its family's row describes it (see the module's doc)."""

    def __init__(self, spec: ModelSpec, embed: np.ndarray, blocks: list[Block], norm: np.ndarray, lm_head: np.ndarray):
        super().__init__()
        self.spec, self.embed, self.blocks, self.norm, self.lm_head = spec, embed, blocks, norm, lm_head
        self.dtype = embed.dtype

    @classmethod
    def from_checkpoint(cls, spec: ModelSpec, checkpoint: Checkpoint, dtype=np.float32,
                        layers: range | None = None) -> "Model":
        w = CheckpointWeights(checkpoint, dtype, layers)
        arch = spec.architecture

        def norm(tensor: T, layer: int | None = None) -> np.ndarray:  # Gemma's (1 + w) with its norm_offset
            return read_weight(w, spec, tensor, layer) + dtype(arch.norm_offset)

        blocks = w.blocks(spec, lambda i: load_block(w, spec, i, norm))
        embed = read_weight(w, spec, T.TOKEN_EMBD)
        untied = not spec.tied_embeddings and arch.hf_name(T.OUTPUT) in checkpoint
        lm_head = read_weight(w, spec, T.OUTPUT) if untied else embed
        return cls(spec, embed, blocks, norm(T.OUTPUT_NORM), lm_head)

    def stages(self, tokens: np.ndarray, cache: KVCache) -> Stages:
        s = self.spec
        start = cache.length
        positions = np.arange(start, start + len(tokens))
        rotations = {}  # (theta, scaling) -> its rotation: one, or Gemma 3's global and local ones
        for rope in {s.layer_rope(i) for i in range(s.n_layers)}:
            cos, sin = rope_tables(positions, s.head_dim, *rope, self.context_size or s.max_positions, self.dtype)
            rotations[rope] = partial(apply_rope, cos=cos, sin=sin)

        def norm(weight: np.ndarray, v: np.ndarray) -> np.ndarray:
            return rms_norm(v, weight, s.norm_eps)

        layers = [partial(self.layer, i, b, cache=cache, start=start, norm=norm, rotate=rotations[s.layer_rope(i)])
                  for i, b in enumerate(self.blocks)]
        scale = embedding_scale(s)
        embedded = self.embed[tokens] if scale is None else self.embed[tokens] * self.dtype.type(scale)
        return Stages(embedded, layers, lambda x: self.head(rms_norm(x, self.norm, s.norm_eps)))


ARCHITECTURE = Architecture(
    name="llama",
    gguf_name="llama",
    model_types=("llama",),
    hf_classes=("LlamaForCausalLM",),
    before=(TensorRow(T.TOKEN_EMBD, "model.embed_tokens"),),
    block=block_rows(
        "model.layers.{bid}.",
        (T.ATTN_NORM, "input_layernorm"),
        (T.ATTN_Q, "self_attn.q_proj"),
        (T.ATTN_K, "self_attn.k_proj"),
        (T.ATTN_V, "self_attn.v_proj"),
        (T.ATTN_OUT, "self_attn.o_proj"),
        (T.FFN_NORM, "post_attention_layernorm"),
        (T.FFN_GATE, "mlp.gate_proj"),
        (T.FFN_UP, "mlp.up_proj"),
        (T.FFN_DOWN, "mlp.down_proj"),
    ),
    after=(TensorRow(T.OUTPUT_NORM, "model.norm"), TensorRow(T.OUTPUT, "lm_head")),
    spec_from_config=spec_from_config,
    config_keys=CONFIG_KEYS,
    model=Model,
    gguf_names=("llama", "bamboo"),
    powerinfer_drelu_name="bamboo",
    rope_kinds=(RopeKind.NONE, RopeKind.LINEAR, RopeKind.LLAMA3, RopeKind.YARN),
)
