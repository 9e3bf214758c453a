"""Phi-3 (transformers' ``Phi3ForCausalLM``, llama.cpp's ``phi3``): LLaMA's computation with fused tensors.

The checkpoint holds q, k and v as one ``qkv_proj`` and the gate and up projections as one ``gate_up_proj``
(gate first); llama.cpp's converter keeps them fused (``attn_qkv``, a ``ffn_up`` of twice the width) and its
rope rotates halves ("neox"). Its row's fused tensors (``formats/architecture.py``) are split where a part is
needed: by the reference engine, by a sparse file (whose gate and up rows are chosen apart), and by the runtime
as views of a dense file's rows. The reference model is LLaMA's.

The long-context variants (Phi-3-mini-128k, Phi-3.5-mini) rotate by ``longrope`` (``formats/rope.py``): per
rotation pair, short factors or long ones, chosen once per run from its context window as llama.cpp chooses them
(long when the window, ``-c/--ctx-size``, by default the model's 131072 positions, exceeds
``original_max_position_embeddings``), cos and sin multiplied by the attention factor llama.cpp's converter writes.
transformers chooses per forward pass by the positions it reaches; the two agree whenever the prompt and the window
lie on the same side of ``original_max_position_embeddings`` (docs/reference/supported-models.md). A file of
llama.cpp's converter holds the lists as the ``rope_factors_long``/``rope_factors_short`` tensors.

Refused: a partial rotary factor, and a config whose ``attention_factor`` (or ``factor``) sets another attention
factor than the one llama.cpp's converter writes (``models/base.py``).

Phi-3-mini attends within a window of 2047 keys, as transformers computes it and we do; llama.cpp's phi3 reads the
window and does not apply it, so beyond 2047 positions it computes another model. llama.cpp's converter writes a
window of 0 for a config without one (Phi-4's): no window.
"""

from __future__ import annotations

import dataclasses

from gguf import MODEL_TENSOR as T
from gguf import Keys

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.architecture import RopePairs, block_rows
from powerinfer_tools.formats.model_spec import ModelSpec
from powerinfer_tools.formats.rope import RopeKind
from powerinfer_tools.models import llama


def spec_from_config(config: dict) -> ModelSpec:
    # transformers 5 writes the factor into rope_parameters, released configs (Phi-4-mini's) at the top.
    for place in (config, config.get("rope_parameters") or config.get("rope_scaling") or {}):
        partial = place.get("partial_rotary_factor", 1.0) if isinstance(place, dict) else 1.0
        if partial != 1.0:
            raise PitoolsError(f"phi3 models with partial_rotary_factor={partial!r:.20} are not supported (only "
                               "whole heads are rotated)")
    return llama.spec_from_config(config, architecture=ARCHITECTURE)


def gguf_fields(get) -> dict:
    """A window of 0 in a file is none (what llama.cpp's converter writes for a config without one)."""
    return {"sliding_window": get(Keys.Attention.SLIDING_WINDOW) or None}


ARCHITECTURE = dataclasses.replace(
    llama.ARCHITECTURE,
    name="phi3",
    gguf_name="phi3",
    model_types=("phi3",),
    hf_classes=("Phi3ForCausalLM",),
    block=block_rows(
        "model.layers.{bid}.",
        (T.ATTN_NORM, "input_layernorm"),
        (T.ATTN_QKV, "self_attn.qkv_proj", (T.ATTN_Q, T.ATTN_K, T.ATTN_V)),
        (T.ATTN_OUT, "self_attn.o_proj"),
        (T.FFN_NORM, "post_attention_layernorm"),
        (T.FFN_UP, "mlp.gate_up_proj", (T.FFN_GATE, T.FFN_UP)),
        (T.FFN_DOWN, "mlp.down_proj"),
    ),
    spec_from_config=spec_from_config,
    gguf_names=None,
    powerinfer_drelu_name=None,
    rope_pairs=RopePairs.HALVES,
    rope_kinds=(RopeKind.NONE, RopeKind.LONGROPE),
    gguf_fields=gguf_fields,
)
