"""Mistral family: SiLU Mistral, and the ReLU-family sparse variants (TurboSparse-Mistral, Bamboo).

Mistral computes exactly what LLaMA does, plus sliding-window attention, so the
LLaMA model class and tensors serve; only reading the config differs. Bamboo
checkpoints (``model_type: bamboo``) use dReLU, which PowerInfer calls the
symmetric gate: ``down(relu(gate x) * relu(up x))``. llama.cpp writes Mistral as
"llama", so a GGUF file of it reads back as LLaMA's family (the same computation).
"""

from __future__ import annotations

import dataclasses

from powerinfer_tools.formats.model_spec import FFNKind, ModelSpec
from powerinfer_tools.formats.rope import RopeKind
from powerinfer_tools.models import llama

BAMBOO = "bamboo"


def spec_from_config(config: dict) -> ModelSpec:
    ffn = FFNKind.DRELU if config.get("model_type") == BAMBOO else None
    return llama.spec_from_config(config, architecture=ARCHITECTURE, ffn=ffn)


ARCHITECTURE = dataclasses.replace(
    llama.ARCHITECTURE,
    name="mistral",
    model_types=("mistral", BAMBOO),
    hf_classes=("MistralForCausalLM",),
    spec_from_config=spec_from_config,
    gguf_names=(),
    rope_kinds=(RopeKind.NONE, RopeKind.LINEAR, RopeKind.YARN),
)
