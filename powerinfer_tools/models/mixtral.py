"""Mixtral family: Mixtral (SiLU experts), ReLU-gated experts, and TurboSparse-Mixtral's dReLU experts.

Attention and norms are Mistral's, so the LLaMA model class serves; each layer's FFN is a
router over ``num_local_experts`` gated FFNs, ``num_experts_per_tok`` of them per token
(``models.layers.mixture_of_experts``). TurboSparse-Mixtral's custom ``model_type`` means dReLU
experts whatever its ``hidden_act`` says, as ``bamboo`` does for Mistral; ``hidden_act: drelu``
says the same of a plain ``mixtral`` config. GGUF stores the experts stacked ([experts, d_ff, d_model] for
gate and up, [experts, d_model, d_ff] for down) as llama.cpp's converter does, under the "llama"
architecture with expert-count keys.
"""

from __future__ import annotations

import dataclasses

from gguf import MODEL_TENSOR as T

from powerinfer_tools.formats.architecture import block_rows
from powerinfer_tools.formats.model_spec import FFNKind, ModelSpec
from powerinfer_tools.models import llama
from powerinfer_tools.models.base import require

CONFIG_KEYS = {**llama.CONFIG_KEYS, "n_experts": "num_local_experts", "n_experts_used": "num_experts_per_tok"}
TURBOSPARSE = "turbosparse_mixtral"
_FFN = (T.FFN_GATE, T.FFN_UP, T.FFN_DOWN)


def spec_from_config(config: dict) -> ModelSpec:
    ffn = FFNKind.DRELU if config.get("model_type") == TURBOSPARSE else None
    spec = llama.spec_from_config(config, architecture=ARCHITECTURE, ffn=ffn)
    return dataclasses.replace(spec, n_experts=require(config, "num_local_experts", ARCHITECTURE),
                               n_experts_used=require(config, "num_experts_per_tok", ARCHITECTURE))


ARCHITECTURE = dataclasses.replace(
    llama.ARCHITECTURE,
    name="mixtral",
    model_types=("mixtral", TURBOSPARSE),
    hf_classes=("MixtralForCausalLM",),
    block=tuple(row for row in llama.ARCHITECTURE.block if row.tensor not in _FFN) + block_rows(  # all but the FFN
        "model.layers.{bid}.block_sparse_moe.",
        (T.FFN_GATE_INP, "gate"),
        (T.FFN_GATE_EXP, "experts.{xid}.w1"),
        (T.FFN_UP_EXP, "experts.{xid}.w3"),
        (T.FFN_DOWN_EXP, "experts.{xid}.w2"),
    ),
    spec_from_config=spec_from_config,
    config_keys=CONFIG_KEYS,
    moe=True,
)
