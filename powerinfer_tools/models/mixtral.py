"""Mixtral family: Mixtral (SiLU experts), ReLU-gated experts, and TurboSparse-Mixtral's dReLU experts.

Attention and norms are Mistral's, so the LLaMA model class serves; each layer's FFN is a
router over ``num_local_experts`` gated FFNs, ``num_experts_per_tok`` of them per token
(``models.layers.mixture_of_experts``). TurboSparse-Mixtral's custom ``model_type`` means dReLU
experts whatever its ``hidden_act`` says, as ``bamboo`` does for Mistral; ``hidden_act: drelu``
says the same of a plain ``mixtral`` config.
"""

from __future__ import annotations

import dataclasses

from powerinfer_tools.formats.model_spec import FFNKind, ModelSpec
from powerinfer_tools.models import llama
from powerinfer_tools.models.base import require

Model = llama.Model
CONFIG_KEYS = {**llama.CONFIG_KEYS, "n_experts": "num_local_experts", "n_experts_used": "num_experts_per_tok"}
TURBOSPARSE = "turbosparse_mixtral"


def spec_from_config(config: dict) -> ModelSpec:
    ffn = FFNKind.DRELU if config.get("model_type") == TURBOSPARSE else None
    spec = llama.spec_from_config(config, architecture="mixtral", ffn=ffn)
    return dataclasses.replace(spec, n_experts=require(config, "num_local_experts", "mixtral"),
                               n_experts_used=require(config, "num_experts_per_tok", "mixtral"))
