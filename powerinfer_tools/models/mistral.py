"""Mistral family: SiLU Mistral, and the ReLU-family sparse variants (TurboSparse-Mistral, Bamboo).

Mistral computes exactly what LLaMA does, plus sliding-window attention, so the
LLaMA model class serves both; only reading the config differs. Bamboo
checkpoints (``model_type: bamboo``) use dReLU, which PowerInfer calls the
symmetric gate: ``down(relu(gate x) * relu(up x))``.
"""

from __future__ import annotations

from powerinfer_tools.formats.model_spec import FFNKind, ModelSpec
from powerinfer_tools.models import llama

Model = llama.Model
CONFIG_KEYS = llama.CONFIG_KEYS


def spec_from_config(config: dict) -> ModelSpec:
    ffn = FFNKind.DRELU if config.get("model_type") == "bamboo" else None
    return llama.spec_from_config(config, architecture="mistral", ffn=ffn)
