"""Qwen3 (dense; transformers' ``Qwen3ForCausalLM``, llama.cpp's ``qwen3``): Qwen2 without q/k/v biases, with q
and k RMS-normed per head before RoPE.

The reference model is LLaMA's (``models.llama.Model``), which applies the q/k norms its row names; the config
reads as Qwen2's (a sliding window that would matter is refused).
"""

from __future__ import annotations

import dataclasses

from gguf import MODEL_TENSOR as T

from powerinfer_tools.formats.architecture import block_rows
from powerinfer_tools.formats.model_spec import ModelSpec
from powerinfer_tools.models import llama, qwen2


def spec_from_config(config: dict) -> ModelSpec:
    return qwen2.read_config(config, ARCHITECTURE)


ARCHITECTURE = dataclasses.replace(
    qwen2.ARCHITECTURE,
    name="qwen3",
    gguf_name="qwen3",
    model_types=("qwen3",),
    hf_classes=("Qwen3ForCausalLM",),
    block=llama.ARCHITECTURE.block + block_rows("model.layers.{bid}.self_attn.", (T.ATTN_Q_NORM, "q_norm"),
                                                (T.ATTN_K_NORM, "k_norm")),
    spec_from_config=spec_from_config,
    attention_biases=llama.ARCHITECTURE.attention_biases,  # all four, where attention_bias says so
)
