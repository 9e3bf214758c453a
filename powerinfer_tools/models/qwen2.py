"""Qwen2 family (Qwen2, Qwen2.5): LLaMA's block with biases on the q, k and v projections.

RMSNorm, rotate-half RoPE (llama.cpp's "neox": its converter stores q and k in the checkpoint's row order),
a gated MLP (SiLU; ReLU and dReLU read as for LLaMA) and grouped-query attention, so the LLaMA model class
serves: it reads whatever biases the checkpoint holds, and the row names q/k/v's and no output projection's.
Sliding-window attention, which some configs switch on for their upper layers, is not implemented:
such a config is refused unless its window spans the whole context.
"""

from __future__ import annotations

import dataclasses

from gguf import MODEL_TENSOR as T

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.architecture import Architecture, RopePairs
from powerinfer_tools.formats.model_spec import ModelSpec
from powerinfer_tools.formats.rope import RopeKind
from powerinfer_tools.models import llama


def spec_from_config(config: dict) -> ModelSpec:
    # Qwen2's q/k/v projections always have biases; its config has no key that says so.
    return dataclasses.replace(read_config(config, ARCHITECTURE), attention_bias=True)


def read_config(config: dict, architecture: Architecture) -> ModelSpec:
    """A Qwen config (Qwen2's, Qwen3's) as ``architecture``'s: LLaMA's keys, with a window that would matter refused.
    Qwen2's use_sliding_window defaults to false (LLaMA's reading defaults it to true), so the spec never has one."""
    spec = llama.spec_from_config(dict(config, use_sliding_window=False), architecture=architecture)
    _refuse_sliding_window(config, spec.max_positions, architecture)
    return spec


def _refuse_sliding_window(config: dict, max_positions: int, architecture: Architecture) -> None:
    """A window shorter than the context would change what attention sees; a longer one is a no-op."""
    window = config.get("sliding_window")
    if not config.get("use_sliding_window") or window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int):
        raise PitoolsError(f"sliding_window must be an integer, not {window!r:.40}")
    if window < max_positions:
        raise PitoolsError(f"this {architecture} model uses sliding-window attention (use_sliding_window, "
                           f"sliding_window={window} < max_position_embeddings={max_positions}), which is not supported")


ARCHITECTURE = dataclasses.replace(
    llama.ARCHITECTURE,
    name="qwen2",
    gguf_name="qwen2",
    model_types=("qwen2",),
    hf_classes=("Qwen2ForCausalLM",),
    spec_from_config=spec_from_config,
    gguf_names=None,
    powerinfer_drelu_name=None,
    rope_pairs=RopePairs.HALVES,
    rope_kinds=(RopeKind.NONE, RopeKind.LINEAR, RopeKind.YARN),
    attention_biases=(T.ATTN_Q, T.ATTN_K, T.ATTN_V),
)
