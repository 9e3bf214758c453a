"""Qwen2 family (Qwen2, Qwen2.5): LLaMA's block with biases on the q, k and v projections.

RMSNorm, rotate-half RoPE, a gated MLP (SiLU; ReLU and dReLU read as for LLaMA) and grouped-query
attention, so the LLaMA model class serves: it reads whatever biases the checkpoint holds, and
the Qwen2 table (``formats.tensor_table.QWEN2``) names q/k/v's and no output projection's.
Sliding-window attention, which some configs switch on for their upper layers, is not implemented:
such a config is refused unless its window spans the whole context.
"""

from __future__ import annotations

import dataclasses

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.model_spec import ModelSpec
from powerinfer_tools.models import llama

ARCHITECTURE = "qwen2"
Model = llama.Model
CONFIG_KEYS = llama.CONFIG_KEYS


def spec_from_config(config: dict) -> ModelSpec:
    # Qwen2's use_sliding_window defaults to false (LLaMA's reading defaults it to true); a window that
    # would matter is refused below, so the spec never has one.
    spec = llama.spec_from_config(dict(config, use_sliding_window=False), architecture=ARCHITECTURE)
    _refuse_sliding_window(config, spec.max_positions)
    # Qwen2's q/k/v projections always have biases; its config has no key that says so.
    return dataclasses.replace(spec, attention_bias=True)


def _refuse_sliding_window(config: dict, max_positions: int) -> None:
    """A window shorter than the context would change what attention sees; a longer one is a no-op."""
    window = config.get("sliding_window")
    if not config.get("use_sliding_window") or window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int):
        raise PitoolsError(f"sliding_window must be an integer, not {window!r:.40}")
    if window < max_positions:
        raise PitoolsError(f"this qwen2 model uses sliding-window attention (use_sliding_window, sliding_window="
                           f"{window} < max_position_embeddings={max_positions}), which is not supported")
