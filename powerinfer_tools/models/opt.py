"""OPT: ReLU FFN with biases, learned positions (offset 2), pre- or post-LayerNorm blocks.

OPT-350m is the odd one: post-LayerNorm blocks (``do_layer_norm_before: false``)
and 512-wide embeddings projected in and out of the 1024-wide decoder
(``word_embed_proj_dim``).
"""

from __future__ import annotations

from functools import partial

import numpy as np
from gguf import MODEL_TENSOR as T

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.architecture import Architecture, TensorRow, block_rows
from powerinfer_tools.formats.model_spec import OPT_POSITION_OFFSET, FFNKind, ModelSpec, NormKind
from powerinfer_tools.formats.rope import RopeKind
from powerinfer_tools.models.base import (Block, CheckpointWeights, DecoderModel, Stages, load_block, optional, require,
                                          token_id)
from powerinfer_tools.models.layers import KVCache, Norm, linear, normalize

# ModelSpec fields -> the config.json keys they come from, for error messages.
CONFIG_KEYS = {
    "n_layers": "num_hidden_layers",
    "d_model": "hidden_size",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_attention_heads",
    "d_ff": "ffn_dim",
    "max_positions": "max_position_embeddings",
    "tied_embeddings": "tie_word_embeddings",
    "attention_bias": "enable_bias",
    "ffn_bias": "enable_bias",
    "pre_norm": "do_layer_norm_before",
    "embed_dim": "word_embed_proj_dim",
}


def spec_from_config(config: dict) -> ModelSpec:
    act = config.get("activation_function", "relu")
    if act != "relu":
        raise PitoolsError(f"opt models with activation_function={act!r} are not supported (supported: relu)")
    d_model = require(config, "hidden_size", ARCHITECTURE)
    n_heads = require(config, "num_attention_heads", ARCHITECTURE)
    embed_dim = optional(config, "word_embed_proj_dim", d_model)
    pre_norm = optional(config, "do_layer_norm_before", True)
    bias = optional(config, "enable_bias", True)
    if not config.get("layer_norm_elementwise_affine", True):
        raise PitoolsError("opt models without LayerNorm weights (layer_norm_elementwise_affine=false) are not supported")
    return ModelSpec(
        architecture=ARCHITECTURE,
        n_layers=require(config, "num_hidden_layers", ARCHITECTURE),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_heads,
        head_dim=None,  # derived: d_model / n_heads
        d_ff=require(config, "ffn_dim", ARCHITECTURE),
        vocab_size=require(config, "vocab_size", ARCHITECTURE),
        max_positions=optional(config, "max_position_embeddings", 2048),
        norm=NormKind.LAYER,
        norm_eps=1e-5,  # torch.nn.LayerNorm's default, which OPT uses
        ffn=FFNKind.RELU,
        tied_embeddings=optional(config, "tie_word_embeddings", True),
        attention_bias=bias,
        ffn_bias=bias,
        pre_norm=pre_norm,
        final_norm=pre_norm and not config.get("_remove_final_layer_norm", False),
        embed_dim=embed_dim if embed_dim != d_model else None,
        position_offset=OPT_POSITION_OFFSET,
        bos_token_id=token_id(config, "bos_token_id"),
        eos_token_id=token_id(config, "eos_token_id"),
    )


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
    def from_checkpoint(cls, spec: ModelSpec, checkpoint: Checkpoint, dtype=np.float32,
                        layers: range | None = None) -> "Model":
        w = CheckpointWeights(checkpoint, dtype, layers)
        d = spec.d_model
        hf = ARCHITECTURE.hf_name  # the checkpoint's tensor names

        def norm(tensor: T, layer: int | None = None) -> Norm:
            return Norm(w.get(hf(tensor, layer), d), w.get(hf(tensor, layer, "bias"), d))

        blocks = w.blocks(spec, lambda i: load_block(w, spec, i, norm))
        embed = w.get(hf(T.TOKEN_EMBD), spec.vocab_size, spec.token_embed_dim)
        lm_head = ARCHITECTURE.row(None, "lm_head").hf_name()
        untied = not spec.tied_embeddings and lm_head in checkpoint
        tensors = {
            "embed": embed,
            "positions": w.get(hf(T.POS_EMBD), spec.max_positions + spec.position_offset, d),
            "lm_head": w.get(lm_head, spec.vocab_size, spec.token_embed_dim) if untied else embed,
        }
        if spec.embed_dim is not None:
            tensors["project_in"] = w.get(ARCHITECTURE.row(None, "project_in").hf_name(), d, spec.embed_dim)
            tensors["project_out"] = w.get(ARCHITECTURE.row(None, "project_out").hf_name(), spec.embed_dim, d)
        if spec.final_norm:
            tensors["final_norm"] = norm(T.OUTPUT_NORM)
        return cls(spec, tensors, blocks)

    def stages(self, tokens: np.ndarray, cache: KVCache) -> Stages:
        s = self.spec
        start = cache.length
        x = self.embed[tokens]
        if self.project_in is not None:
            x = linear(x, self.project_in)
        x = x + self.positions[start + s.position_offset : start + s.position_offset + len(tokens)]

        def ln(norm: Norm, v: np.ndarray) -> np.ndarray:
            return normalize(s.norm, norm, v, s.norm_eps)

        def finish(x: np.ndarray) -> np.ndarray:
            if self.final_norm is not None:
                x = ln(self.final_norm, x)
            if self.project_out is not None:
                x = linear(x, self.project_out)
            return self.head(x)

        return Stages(x, [partial(self.layer, i, b, cache=cache, start=start, norm=ln)
                          for i, b in enumerate(self.blocks)], finish)


def check_layout(spec: ModelSpec) -> None:
    """PowerInfer's opt (llama.cpp has none) is pre-norm with embeddings of the model's width, tied to the head."""
    if spec.embed_dim is not None or not spec.pre_norm or not spec.final_norm:
        raise PitoolsError(
            "OPT variants with post-LayerNorm blocks or projected embeddings (OPT-350m) have no GGUF layout "
            "in llama.cpp or PowerInfer; they cannot be converted"
        )
    if not spec.tied_embeddings:
        raise PitoolsError("OPT with an untied lm_head has no GGUF layout (PowerInfer's OPT computes the logits with its token embedding)")


_DECODER = "model.decoder."
ARCHITECTURE = Architecture(
    name="opt",
    gguf_name="opt",
    model_types=("opt",),
    hf_classes=("OPTForCausalLM",),
    before=(
        TensorRow(T.TOKEN_EMBD, _DECODER + "embed_tokens"),
        TensorRow(T.POS_EMBD, _DECODER + "embed_positions"),  # with OPT's two leading offset rows
        TensorRow(None, _DECODER + "project_in"),
    ),
    block=block_rows(
        _DECODER + "layers.{bid}.",
        (T.ATTN_NORM, "self_attn_layer_norm"),
        (T.ATTN_Q, "self_attn.q_proj"),
        (T.ATTN_K, "self_attn.k_proj"),
        (T.ATTN_V, "self_attn.v_proj"),
        (T.ATTN_OUT, "self_attn.out_proj"),
        (T.FFN_NORM, "final_layer_norm"),
        (T.FFN_UP, "fc1"),
        (T.FFN_DOWN, "fc2"),
    ),
    # PowerInfer's OPT computes the logits with token_embd: there is no output tensor.
    after=(
        TensorRow(None, _DECODER + "project_out"),
        TensorRow(T.OUTPUT_NORM, _DECODER + "final_layer_norm"),
        TensorRow(None, "lm_head"),  # untied OPT checkpoints only, which have no GGUF layout
    ),
    spec_from_config=spec_from_config,
    config_keys=CONFIG_KEYS,
    model=Model,
    ffn_kinds=(FFNKind.RELU,),
    dense_ffn=FFNKind.RELU,
    sparse_ffn=FFNKind.RELU,
    norm=NormKind.LAYER,
    rope_kinds=(RopeKind.NONE,),
    check_layout=check_layout,
)
