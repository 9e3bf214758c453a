"""LLaMA family: ReluLLaMA and ProSparse (ReGLU), plain SiLU LLaMA, and dReLU variants."""

from __future__ import annotations

from functools import partial

import numpy as np
from gguf import MODEL_TENSOR as T

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.model_spec import FFNKind, ModelSpec, NormKind
from powerinfer_tools.formats.tensor_table import TABLES
from powerinfer_tools.models.base import (
    Block,
    CheckpointWeights,
    DecoderModel,
    Stages,
    load_block,
    optional,
    require,
    rope_settings,
    token_id,
)
from powerinfer_tools.models.layers import KVCache, apply_rope, rms_norm, rope_tables

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
    "rope_scaling_factor": "rope_scaling factor",
    "tied_embeddings": "tie_word_embeddings",
    "ffn_bias": "mlp_bias",
}
# The ModelSpec fields config.json holds as they are, under the key CONFIG_KEYS names.
_PLAIN_FIELDS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "max_positions", "norm_eps", "tied_embeddings",
                 "ffn_bias")


def gated_ffn_kind(config: dict, architecture: str) -> FFNKind:
    act = config.get("hidden_act", "silu")
    if not isinstance(act, str) or act not in GATED_ACTIVATIONS:
        supported = ", ".join(GATED_ACTIVATIONS)
        raise PitoolsError(f"{architecture} models with hidden_act={act!r} are not supported (supported: {supported})")
    return GATED_ACTIVATIONS[act]


def spec_from_config(config: dict, architecture: str = "llama", ffn: FFNKind | None = None) -> ModelSpec:
    n_heads = require(config, "num_attention_heads", architecture)
    theta, scaling = rope_settings(config)
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
        rope_scaling_factor=scaling,
        sliding_window=config.get("sliding_window") if config.get("use_sliding_window", True) else None,
        attention_bias=optional(config, "attention_bias", False),
        ffn_bias=optional(config, "mlp_bias", False),
        bos_token_id=token_id(config, "bos_token_id"),
        eos_token_id=token_id(config, "eos_token_id"),
    )


def config_from_spec(spec: ModelSpec) -> dict:
    """The config.json that reads back as ``spec``: how a model that comes without one (a GGUF file
    converted as a checkpoint) is read. Every architecture that reads its config through
    ``spec_from_config`` above (LLaMA, Mistral, Mixtral, Qwen2) has one; the ``model_type`` is its module's."""
    activations = {kind: name for name, kind in GATED_ACTIVATIONS.items()}
    if spec.ffn not in activations:
        raise PitoolsError(f"a {spec.architecture} model with a {spec.ffn.value} FFN has no config.json of this family")
    config = {CONFIG_KEYS[field]: getattr(spec, field) for field in _PLAIN_FIELDS}
    config.update(model_type=spec.architecture, head_dim=spec.head_dim, vocab_size=spec.vocab_size,
                  hidden_act=activations[spec.ffn], rope_theta=spec.rope_theta, sliding_window=spec.sliding_window,
                  attention_bias=spec.attention_bias, bos_token_id=spec.bos_token_id, eos_token_id=spec.eos_token_id)
    if spec.rope_scaling_factor != 1.0:
        config["rope_scaling"] = {"rope_type": "linear", "factor": spec.rope_scaling_factor}
    if spec.moe:  # Mixtral's keys (models/mixtral.py)
        config.update(num_local_experts=spec.n_experts, num_experts_per_tok=spec.n_experts_used)
    return config


class Model(DecoderModel):
    def __init__(self, spec: ModelSpec, embed: np.ndarray, blocks: list[Block], norm: np.ndarray, lm_head: np.ndarray):
        super().__init__()
        self.spec, self.embed, self.blocks, self.norm, self.lm_head = spec, embed, blocks, norm, lm_head
        self.dtype = embed.dtype

    @classmethod
    def from_checkpoint(cls, spec: ModelSpec, checkpoint: Checkpoint, dtype=np.float32,
                        layers: range | None = None) -> "Model":
        w = CheckpointWeights(checkpoint, dtype, layers)
        d, vocab = spec.d_model, spec.vocab_size
        table = TABLES[spec.architecture]  # LLaMA's, or Mixtral's with experts
        hf = table.hf_name  # the checkpoint's tensor names

        def norm(tensor: T, layer: int | None = None) -> np.ndarray:
            return w.get(hf(tensor, layer), d)

        blocks = w.blocks(spec, lambda i: load_block(w, table, spec, i, norm))
        embed = w.get(hf(T.TOKEN_EMBD), vocab, d)
        untied = not spec.tied_embeddings and hf(T.OUTPUT) in checkpoint
        lm_head = w.get(hf(T.OUTPUT), vocab, d) if untied else embed
        return cls(spec, embed, blocks, norm(T.OUTPUT_NORM), lm_head)

    def stages(self, tokens: np.ndarray, cache: KVCache) -> Stages:
        s = self.spec
        start = cache.length
        positions = np.arange(start, start + len(tokens))
        cos, sin = rope_tables(positions, s.head_dim, s.rope_theta, s.rope_scaling_factor, self.dtype)

        def norm(weight: np.ndarray, v: np.ndarray) -> np.ndarray:
            return rms_norm(v, weight, s.norm_eps)

        def rotate(t: np.ndarray) -> np.ndarray:
            return apply_rope(t, cos, sin)

        layers = [partial(self.layer, i, b, cache=cache, start=start, norm=norm, rotate=rotate)
                  for i, b in enumerate(self.blocks)]
        return Stages(self.embed[tokens], layers, lambda x: self.head(rms_norm(x, self.norm, s.norm_eps)))
