"""Gemma 2 (transformers' ``Gemma2ForCausalLM``, llama.cpp's ``gemma2``).

Gemma 3's block without its q/k norms (``models/gemma3.py``): GeGLU FFN, attention and FFN outputs normed again
before they join the residual stream, RMSNorms scaling by ``1 + w``, embeddings multiplied by sqrt(d_model), scores
scaled by ``query_pre_attn_scalar``; every other layer (the first of each pair) attends within a sliding window,
all with one RoPE base. What Gemma 2 adds is soft-capping (``formats/soft_cap.py``): attention scores, once
scaled and before the mask, become ``cap * tanh(score / cap)`` (``attn_logit_softcapping``), and so do the final
logits (``final_logit_softcapping``); ``ModelSpec`` holds both caps, which ``models/layers.py`` and the runtime's
attention kernels apply. The reference model is LLaMA's (``models.llama.Model``), told of the rest by the row.
"""

from __future__ import annotations

import dataclasses

from gguf import MODEL_TENSOR as T
from gguf import Keys

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.model_spec import ModelSpec
from powerinfer_tools.formats.rope import RopeKind
from powerinfer_tools.models import gemma3, llama
from powerinfer_tools.models.base import optional

MODEL_TYPE = "gemma2"
_CAPS = ("attn_logit_softcapping", "final_logit_softcapping")  # ModelSpec's fields, named as config.json names them
# Gemma2Config's defaults, and llama.cpp's for a file without the keys: the caps and the window.
_DEFAULT_CAPS = (50.0, 30.0)
_DEFAULT_WINDOW = 4096
# Every other layer slides, the first of each pair: Gemma2Config's default layer_types, and what llama.cpp's gemma2
# assumes.
_SLIDING_WINDOW_PATTERN = 2


def spec_from_config(config: dict) -> ModelSpec:
    activation = config.get("hidden_activation", gemma3.ACTIVATION)
    if activation != gemma3.ACTIVATION:
        raise PitoolsError(f"gemma2 models with hidden_activation={activation!r} are not supported "
                           f"(supported: {gemma3.ACTIVATION})")
    for flag in ("attention_bias", "use_bidirectional_attention"):
        if config.get(flag):
            raise PitoolsError(f"gemma2 models with {flag} are not supported")
    if not optional(config, "tie_word_embeddings", True):
        raise PitoolsError("gemma2 models with untied embeddings are not supported (llama.cpp's gemma2 computes the "
                           "logits with the token embedding)")
    return gemma3.gemma_spec(
        config, ARCHITECTURE, config, max_positions=optional(config, "max_position_embeddings", 8192),
        tied_embeddings=True,
        sliding_window=config.get("sliding_window", _DEFAULT_WINDOW),  # null: every layer attends to all before it
        sliding_window_pattern=gemma3.sliding_window_pattern(config, _SLIDING_WINDOW_PATTERN),
        # Present and null: not capped, as transformers reads it.
        **{cap: config.get(cap, default) for cap, default in zip(_CAPS, _DEFAULT_CAPS)},
    )


# What llama.cpp's gemma2 assumes rather than reads (src/models/gemma2.cpp): the layer pattern, every layer rotating
# with the one base, queries scaled by 1/sqrt(head_dim) except in the 27B model (46 layers), whose scale is
# 1/sqrt(d_model / n_heads); the window and the caps where a file has no keys (the defaults above).
_GEMMA2_27B_LAYERS = 46
_CAP_KEYS = (Keys.LLM.ATTN_LOGIT_SOFTCAPPING, Keys.LLM.FINAL_LOGIT_SOFTCAPPING)


def gguf_fields(get) -> dict:
    """The fields llama.cpp's gemma2 assumes, or reads with a default of its own (above); ``get`` reads the file's
    metadata."""
    return {"sliding_window_pattern": _SLIDING_WINDOW_PATTERN,
            "sliding_window": get(Keys.Attention.SLIDING_WINDOW, _DEFAULT_WINDOW),
            "query_pre_attn_scalar": gemma3.stored_query_pre_attn_scalar(get, _GEMMA2_27B_LAYERS),
            **{cap: get(key, default) for cap, key, default in zip(_CAPS, _CAP_KEYS, _DEFAULT_CAPS)}}


def check_layout(spec: ModelSpec) -> None:
    """llama.cpp's gemma2 assumes its layer pattern and query scale, and caps scores and logits whatever a file
    says (a file without the keys at 50 and 30): a model that differs, or is not capped, is refused."""
    gemma3.check_assumed(spec, {"sliding_window_pattern": _SLIDING_WINDOW_PATTERN,
                                "query_pre_attn_scalar": gemma3.gguf_query_pre_attn_scalar(
                                    _GEMMA2_27B_LAYERS, spec.n_layers, spec.d_model, spec.n_heads, spec.head_dim)})
    for cap in _CAPS:
        if getattr(spec, cap) is None:
            raise PitoolsError(f"a gemma2 model without {cap} has no GGUF layout (llama.cpp's gemma2 always caps)")


ARCHITECTURE = dataclasses.replace(
    gemma3.ARCHITECTURE,
    name="gemma2",
    gguf_name="gemma2",
    model_types=(MODEL_TYPE,),
    hf_classes=("Gemma2ForCausalLM",),
    block=tuple(row for row in gemma3.ARCHITECTURE.block if row.tensor not in (T.ATTN_Q_NORM, T.ATTN_K_NORM)),
    # No output.weight: llama.cpp's gemma2 computes the logits with the token embedding, and refuses a file that
    # holds one (its converter drops a checkpoint's lm_head).
    after=tuple(row for row in gemma3.ARCHITECTURE.after if row.tensor is not T.OUTPUT),
    spec_from_config=spec_from_config,
    config_keys={**llama.CONFIG_KEYS, "sliding_window_pattern": "layer_types"},
    rope_kinds=(RopeKind.NONE,),
    gguf_fields=gguf_fields,
    gguf_keys=_CAP_KEYS,
    check_layout=check_layout,
)
