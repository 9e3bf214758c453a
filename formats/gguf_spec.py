"""The ``ModelSpec`` of a model file, read back from its GGUF metadata given its family.

This is the inverse of ``gguf_names.add_hyperparameters``. Files written by other
tools lack our ``pitools.ffn_activation`` key; their activation then follows
from the family the way llama.cpp and PowerInfer decide it (``Architecture.dense_ffn``,
``sparse_ffn``; a file named as PowerInfer's dReLU model, ``bamboo``, is dReLU).

Every ``{arch}.*`` key of the file must be one this reading applies (or checks to hold its neutral
value): a key that would change what llama.cpp computes and that we do not apply is refused, naming
it, never ignored (``models.spec_from_model_file`` finds the family; ``formats/model_check.py`` does
the same for tensors). Values are passed on as the file holds them: ``ModelSpec`` checks their types
and ranges, and its errors name the file and the metadata key.
"""

from __future__ import annotations

from typing import Any

from gguf import MODEL_TENSOR, Keys
from powerinfer_tools.formats.architecture import Architecture
from powerinfer_tools.formats.constants import (FFN_ACTIVATION_KEY, PREDICTOR_COMPUTED_KEY, PREDICTOR_PRECISION_KEY,
                                                PREDICTOR_RECALL_KEY, tensor_name)
from powerinfer_tools.formats.model_file import ModelFile
from powerinfer_tools.formats.quantization import decode
from powerinfer_tools.formats.model_spec import OPT_POSITION_OFFSET, FFNKind, ModelSpec, NormKind, spec_errors_named
from powerinfer_tools.formats.rope import YARN_BETA_FAST, YARN_BETA_SLOW, RopeKind, RopeScaling

from powerinfer_tools.errors import PitoolsError

# ModelSpec fields -> the metadata keys they are read from ({arch}: the architecture).
METADATA_KEYS = {
    "n_layers": Keys.LLM.BLOCK_COUNT,
    "d_model": Keys.LLM.EMBEDDING_LENGTH,
    "n_heads": Keys.Attention.HEAD_COUNT,
    "n_kv_heads": Keys.Attention.HEAD_COUNT_KV,
    "head_dim": Keys.Attention.KEY_LENGTH,
    "d_ff": Keys.LLM.FEED_FORWARD_LENGTH,
    "vocab_size": Keys.LLM.VOCAB_SIZE,
    "max_positions": Keys.LLM.CONTEXT_LENGTH,
    "rope_theta": Keys.Rope.FREQ_BASE,
    "rope_scaling": Keys.Rope.SCALING_TYPE,
    "rope_scaling_factor": Keys.Rope.SCALING_FACTOR,
    "sliding_window": Keys.Attention.SLIDING_WINDOW,
    "bos_token_id": Keys.Tokenizer.BOS_ID,
    "eos_token_id": Keys.Tokenizer.EOS_ID,
    "ffn": FFN_ACTIVATION_KEY,
    "n_experts": Keys.LLM.EXPERT_COUNT,
    "n_experts_used": Keys.LLM.EXPERT_USED_COUNT,
}
TOKENS_KEY = Keys.Tokenizer.LIST
# {arch}.* keys read besides METADATA_KEYS's: checked against the spec (``_check_derived``), or the scaling's.
_CHECKED_KEYS = (Keys.Attention.VALUE_LENGTH, Keys.Rope.DIMENSION_COUNT, Keys.Rope.SCALING_ORIG_CTX_LEN, Keys.Attention.LAYERNORM_EPS, Keys.Attention.LAYERNORM_RMS_EPS)
# A longrope model's factor lists (llama.cpp's tensors), and the keys it applies besides those of every model.
_LONGROPE_TENSORS = {"short": tensor_name(MODEL_TENSOR.ROPE_FACTORS_SHORT),
                     "long": tensor_name(MODEL_TENSOR.ROPE_FACTORS_LONG)}
_LONGROPE_KEYS = (Keys.Rope.SCALING_ATTN_FACTOR,)
# {arch}.* keys that change nothing llama.cpp computes, or only at the value given (what it assumes without them).
_NEUTRAL_KEYS = {Keys.Rope.SCALING_FINETUNED: None, Keys.Rope.SCALING_YARN_BETA_FAST: YARN_BETA_FAST,
                 Keys.Rope.SCALING_YARN_BETA_SLOW: YARN_BETA_SLOW, Keys.Rope.SCALING_ATTN_FACTOR: 1.0}


def _metadata_keys(arch: str, family: Architecture) -> dict[str, str]:
    keys = {field: key.format(arch=arch) for field, key in METADATA_KEYS.items()}
    norm_eps = Keys.Attention.LAYERNORM_EPS if family.norm is NormKind.LAYER else Keys.Attention.LAYERNORM_RMS_EPS
    keys["norm_eps"] = norm_eps.format(arch=arch)
    return keys


def _ffn_kind(model: ModelFile, family: Architecture) -> FFNKind:
    stored = model.get(FFN_ACTIVATION_KEY)
    if stored is not None:
        try:
            return FFNKind(stored)
        except ValueError:
            kinds = ", ".join(kind.value for kind in FFNKind)
            raise PitoolsError(f"{FFN_ACTIVATION_KEY} is {stored!r:.60}; expected one of {kinds}") from None
    return architecture_ffn(family, model.architecture, model.powerinfer)


def architecture_ffn(family: Architecture, gguf_name: str, powerinfer: bool) -> FFNKind:
    """The FFN llama.cpp and PowerInfer's runtime compute for a file of ``family`` named ``gguf_name``, in the
    PowerInfer layout or the dense one: they read it from the architecture alone (``src/models/llama.cpp``: SiLU,
    whatever ``pitools.ffn_activation`` says), as a file without that key is read here."""
    if gguf_name == family.powerinfer_drelu_name:
        return FFNKind.DRELU
    return family.sparse_ffn if powerinfer else family.dense_ffn


def spec_from_model_file(model: ModelFile, family: Architecture) -> ModelSpec:
    """The spec of ``model``, a file of ``family``; a missing, mistyped or out-of-range value, or a key the family
    does not apply, is an error naming the file and key."""
    keys = _metadata_keys(model.architecture, family)
    named = keys | {"rope_attention_factor": Keys.Rope.SCALING_ATTN_FACTOR.format(arch=model.architecture),
                    "rope_short_factors": f"tensor {_LONGROPE_TENSORS['short']}",
                    "rope_long_factors": f"tensor {_LONGROPE_TENSORS['long']}"}
    with spec_errors_named(model.path, named):
        _refuse_unknown_keys(model, family, keys)
        spec = _spec(model, family, keys)
        _check_derived(model, spec)
        return spec


def _refuse_unknown_keys(model: ModelFile, family: Architecture, keys: dict[str, str]) -> None:
    """A key of the architecture's own (``{arch}.*``) that this reading neither applies nor checks would change
    what llama.cpp computes without us knowing: the file is refused, naming it."""
    arch = model.architecture
    applied = _CHECKED_KEYS + family.gguf_keys + (_LONGROPE_KEYS if _holds_longrope(model, family) else ())
    understood = set(keys.values()) | {key.format(arch=arch) for key in applied}
    for key in model.metadata:
        if not key.startswith(f"{arch}.") or key in understood:
            continue
        neutral = {k.format(arch=arch): v for k, v in _NEUTRAL_KEYS.items()}
        if key in neutral and neutral[key] in (None, model.metadata[key]):
            continue
        raise PitoolsError(f"metadata key {key} ({model.metadata[key]!r:.40}) changes what a {family} model "
                           "computes, and the runtime does not apply it; the file cannot be run")


def _spec(model: ModelFile, family: Architecture, keys: dict[str, str]) -> ModelSpec:
    def value(field: str, default: Any = None) -> Any:
        return model.metadata.get(keys[field], default)

    def need(field: str) -> Any:
        found = value(field)
        if found is None:
            raise PitoolsError(f"metadata lacks {keys[field]}")
        return found

    n_heads, vocab_size = need("n_heads"), value("vocab_size")
    rotary = family.rotary
    fields = dict(
        architecture=family,
        n_layers=need("n_layers"),
        d_model=need("d_model"),
        n_heads=n_heads,
        n_kv_heads=value("n_kv_heads", n_heads),
        head_dim=value("head_dim"),  # None: derived
        d_ff=need("d_ff"),
        vocab_size=vocab_size if vocab_size is not None else _token_count(model, keys["vocab_size"]),
        max_positions=need("max_positions"),
        norm=family.norm,
        norm_eps=need("norm_eps"),
        ffn=_ffn_kind(model, family),
        tied_embeddings=tensor_name(MODEL_TENSOR.OUTPUT) not in model,
        rope_theta=value("rope_theta", 10000.0) if rotary else None,
        rope_scaling=_rope_scaling(model, family, need("max_positions")) if rotary else RopeScaling(),
        sliding_window=value("sliding_window"),
        attention_bias=tensor_name(MODEL_TENSOR.ATTN_Q, 0, "bias") in model,
        ffn_bias=tensor_name(MODEL_TENSOR.FFN_UP, 0, "bias") in model,
        position_offset=0 if rotary else OPT_POSITION_OFFSET,
        bos_token_id=value("bos_token_id"),
        eos_token_id=value("eos_token_id"),
        n_experts=value("n_experts", 0),
        n_experts_used=value("n_experts_used", 0),
    )
    return ModelSpec(**(fields | family.gguf_fields(model.get)))


def _holds_longrope(model: ModelFile, family: Architecture) -> bool:
    """Whether the file is a longrope model its family reads as one: llama.cpp's ``rope_factors_long`` or
    ``_short`` in a file of a family that has longrope (another family's file keeps them unread, and
    ``formats/model_check.py`` refuses them as tensors it does not have)."""
    return RopeKind.LONGROPE in family.rope_kinds and any(name in model for name in _LONGROPE_TENSORS.values())


def _factors(model: ModelFile, name: str) -> tuple[float, ...]:
    """A tensor of one factor per rotation pair (ModelSpec checks how many)."""
    stored = model[name]
    return tuple(float(v) for v in decode(stored.data, stored.qtype).reshape(-1))


def _rope_scaling(model: ModelFile, family: Architecture, max_positions: Any) -> RopeScaling:
    """The scaling a file's keys and llama.cpp's tensors of factors per rotation pair describe: ``rope_freqs``
    (Llama 3.1's), ``rope_factors_short`` and ``_long`` (longrope's)."""
    kind = model.get(Keys.Rope.SCALING_TYPE, RopeKind.NONE.value)
    factors = tensor_name(MODEL_TENSOR.ROPE_FREQS)
    tensor_scaled = [name for name in (factors, *_LONGROPE_TENSORS.values()) if name in model]
    if tensor_scaled and kind != RopeKind.NONE.value:
        raise PitoolsError(f"tensor {tensor_scaled[0]} and {Keys.Rope.SCALING_TYPE} {kind!r} both scale the rotary "
                           "frequencies; only one may")
    if factors in model:
        return RopeScaling(RopeKind.LLAMA3, frequency_factors=_factors(model, factors))
    if _holds_longrope(model, family):
        missing = [name for name in _LONGROPE_TENSORS.values() if name not in model]
        if missing:
            raise PitoolsError(f"tensor {missing[0]} is missing: a longrope model needs both lists of rope factors")
        # llama.cpp's defaults for a file without the keys: the trained context, and no attention factor.
        return RopeScaling(RopeKind.LONGROPE, original_context=model.get(Keys.Rope.SCALING_ORIG_CTX_LEN, max_positions),
                           short_factors=_factors(model, _LONGROPE_TENSORS["short"]),
                           long_factors=_factors(model, _LONGROPE_TENSORS["long"]),
                           attention_factor=model.get(Keys.Rope.SCALING_ATTN_FACTOR, 1.0))
    keyed = {k.value: k for k in (RopeKind.NONE, RopeKind.LINEAR, RopeKind.YARN)}  # the others are tensors
    if kind not in keyed:
        raise PitoolsError(f"rope scaling type {kind!r:.40} is not supported (supported: {', '.join(keyed)})")
    kind = keyed[kind]
    if kind is RopeKind.NONE:
        return RopeScaling()
    factor = model.get(Keys.Rope.SCALING_FACTOR)
    if factor is None:
        raise PitoolsError(f"metadata lacks {Keys.Rope.SCALING_FACTOR.format(arch=model.architecture)} for its "
                           f"{kind.value} rope scaling")
    return RopeScaling(kind, factor, original_context=model.get(Keys.Rope.SCALING_ORIG_CTX_LEN)
                       if kind is RopeKind.YARN else None)


def _check_derived(model: ModelFile, spec: ModelSpec) -> None:
    """Keys llama.cpp reads that the spec derives: they must say the same (a head rotated in part, or values of
    another width than keys, are not computed)."""
    for key, expected in ((Keys.Attention.VALUE_LENGTH, spec.head_dim), (Keys.Rope.DIMENSION_COUNT, spec.head_dim)):
        found = model.get(key, expected)
        if found != expected:
            raise PitoolsError(f"{key.format(arch=model.architecture)} is {found!r:.40}; only {expected} (the head "
                               "size) is supported")


def _token_count(model: ModelFile, vocab_key: str) -> int:
    """The vocabulary size of a file without ``{arch}.vocab_size``: its token list's length."""
    tokens = model.get(TOKENS_KEY)
    if not isinstance(tokens, list):
        raise PitoolsError(f"metadata lacks {vocab_key}, and {TOKENS_KEY} is no array to count instead")
    return len(tokens)


def predictor_quality(model: ModelFile) -> dict | None:
    """How well the file's predictors did on held-out profile pairs when trained, as ``pitools
    convert`` records it: per layer ``recall``, ``precision`` and ``computed`` (share of neurons
    selected), with the worst recall and the mean precision and computed share; None for a file
    that does not record it (PowerInfer's own, a dense file)."""
    layers = {name: model.get(key) for name, key in (("recall", PREDICTOR_RECALL_KEY),
                                                     ("precision", PREDICTOR_PRECISION_KEY),
                                                     ("computed", PREDICTOR_COMPUTED_KEY))}
    if any(not isinstance(values, list) or not values for values in layers.values()):
        return None
    return {"layers": layers, "worst_recall": min(layers["recall"]),
            "mean_precision": sum(layers["precision"]) / len(layers["precision"]),
            "mean_computed": sum(layers["computed"]) / len(layers["computed"])}
