"""The ``ModelSpec`` of a model file, read back from its GGUF metadata.

This is the inverse of ``gguf_names.add_hyperparameters``. Files written by other
tools lack our ``pitools.ffn_activation`` key; their activation then follows
from the architecture the way PowerInfer's runtime decides it: ``bamboo`` is
dReLU, ``opt`` ReLU, a sparse (PowerInfer) ``llama`` file ReGLU and a dense
``llama`` file SwiGLU.

Values are passed on as the file holds them: ``ModelSpec`` checks their types and
ranges, and its errors name the file and the metadata key.
"""

from __future__ import annotations

from typing import Any

from gguf import MODEL_TENSOR, Keys
from powerinfer_tools.formats.constants import (FFN_ACTIVATION_KEY, PREDICTOR_COMPUTED_KEY, PREDICTOR_PRECISION_KEY,
                                                PREDICTOR_RECALL_KEY, tensor_name)
from powerinfer_tools.formats.gguf_names import (BAMBOO, GEMMA3, GEMMA3_ROPE_LOCAL_THETA, GEMMA3_SLIDING_WINDOW_PATTERN,
                                                 LLAMA, OPT, QWEN2, gemma3_query_pre_attn_scalar)
from powerinfer_tools.formats.model_file import ModelFile
from powerinfer_tools.formats.model_spec import OPT_POSITION_OFFSET, FFNKind, ModelSpec, NormKind, spec_errors_named

from powerinfer_tools.errors import PitoolsError

SUPPORTED_ARCHITECTURES = (LLAMA, BAMBOO, QWEN2, GEMMA3, OPT)

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
    "rope_scaling_factor": Keys.Rope.SCALING_FACTOR,
    "sliding_window": Keys.Attention.SLIDING_WINDOW,
    "bos_token_id": Keys.Tokenizer.BOS_ID,
    "eos_token_id": Keys.Tokenizer.EOS_ID,
    "ffn": FFN_ACTIVATION_KEY,
    "n_experts": Keys.LLM.EXPERT_COUNT,
    "n_experts_used": Keys.LLM.EXPERT_USED_COUNT,
}
TOKENS_KEY = Keys.Tokenizer.LIST


def _metadata_keys(arch: str) -> dict[str, str]:
    keys = {field: key.format(arch=arch) for field, key in METADATA_KEYS.items()}
    norm_eps = Keys.Attention.LAYERNORM_EPS if arch == OPT else Keys.Attention.LAYERNORM_RMS_EPS
    keys["norm_eps"] = norm_eps.format(arch=arch)
    return keys


def _ffn_kind(model: ModelFile) -> FFNKind:
    stored = model.get(FFN_ACTIVATION_KEY)
    if stored is not None:
        try:
            return FFNKind(stored)
        except ValueError:
            kinds = ", ".join(kind.value for kind in FFNKind)
            raise PitoolsError(f"{FFN_ACTIVATION_KEY} is {stored!r:.60}; expected one of {kinds}") from None
    return architecture_ffn(model.architecture, model.powerinfer)


def architecture_ffn(architecture: str, powerinfer: bool) -> FFNKind:
    """The FFN llama.cpp and PowerInfer's runtime compute for a file of GGUF ``architecture`` in the PowerInfer
    layout or the dense one: they read it from the architecture alone (``src/models/llama.cpp``: SiLU, whatever
    ``pitools.ffn_activation`` says), as a file without that key is read here."""
    if architecture == BAMBOO:
        return FFNKind.DRELU
    if architecture == OPT:
        return FFNKind.RELU
    if architecture == GEMMA3:
        return FFNKind.GEGLU
    return FFNKind.REGLU if powerinfer else FFNKind.SWIGLU


def spec_from_model_file(model: ModelFile) -> ModelSpec:
    """The spec of ``model``; a missing, mistyped or out-of-range value is an error naming the file and key."""
    arch = model.architecture
    keys = _metadata_keys(arch)
    with spec_errors_named(model.path, keys):
        if arch not in SUPPORTED_ARCHITECTURES:
            supported = ", ".join(SUPPORTED_ARCHITECTURES)
            raise PitoolsError(f"architecture {arch!r} is not supported (supported: {supported})")
        return _spec(model, arch, keys)


def _spec(model: ModelFile, arch: str, keys: dict[str, str]) -> ModelSpec:
    def value(field: str, default: Any = None) -> Any:
        return model.metadata.get(keys[field], default)

    def need(field: str) -> Any:
        found = value(field)
        if found is None:
            raise PitoolsError(f"metadata lacks {keys[field]}")
        return found

    is_opt = arch == OPT
    n_heads = need("n_heads")
    vocab_size = value("vocab_size")
    linear_rope = model.get(Keys.Rope.SCALING_TYPE, "none") == "linear"
    gemma3 = _gemma3_fields(need("n_layers"), need("d_model"), n_heads, value("head_dim")) if arch == GEMMA3 else {}
    return ModelSpec(
        architecture=_architecture(arch, value("n_experts", 0) != 0),
        n_layers=need("n_layers"),
        d_model=need("d_model"),
        n_heads=n_heads,
        n_kv_heads=value("n_kv_heads", n_heads),
        head_dim=value("head_dim"),  # None: derived
        d_ff=need("d_ff"),
        vocab_size=vocab_size if vocab_size is not None else _token_count(model, keys["vocab_size"]),
        max_positions=need("max_positions"),
        norm=NormKind.LAYER if is_opt else NormKind.RMS,
        norm_eps=need("norm_eps"),
        ffn=_ffn_kind(model),
        tied_embeddings=tensor_name(MODEL_TENSOR.OUTPUT) not in model,
        rope_theta=None if is_opt else value("rope_theta", 10000.0),
        rope_scaling_factor=value("rope_scaling_factor", 1.0) if linear_rope else 1.0,
        sliding_window=value("sliding_window"),
        attention_bias=tensor_name(MODEL_TENSOR.ATTN_Q, 0, "bias") in model,
        ffn_bias=tensor_name(MODEL_TENSOR.FFN_UP, 0, "bias") in model,
        position_offset=OPT_POSITION_OFFSET if is_opt else 0,
        bos_token_id=value("bos_token_id"),
        eos_token_id=value("eos_token_id"),
        n_experts=value("n_experts", 0),
        n_experts_used=value("n_experts_used", 0),
        **gemma3,
    )


def _gemma3_fields(n_layers: Any, d_model: Any, n_heads: Any, head_dim: Any) -> dict:
    """What llama.cpp's gemma3 assumes instead of reading keys (``gguf_names.GEMMA3_*``)."""
    if head_dim is None and isinstance(d_model, int) and isinstance(n_heads, int) and n_heads:
        head_dim = d_model // n_heads
    scalar = None
    if all(isinstance(v, int) and v > 0 for v in (n_layers, d_model, n_heads, head_dim)):  # else ModelSpec says why
        scalar = gemma3_query_pre_attn_scalar(n_layers, d_model, n_heads, head_dim)
    return {"sliding_window_pattern": GEMMA3_SLIDING_WINDOW_PATTERN, "rope_local_theta": GEMMA3_ROPE_LOCAL_THETA,
            "query_pre_attn_scalar": scalar}


def _architecture(arch: str, moe: bool) -> str:
    """Our architecture (``ModelSpec.architecture``) of a file's: a "llama" (or, sparse dReLU, PowerInfer's
    "bamboo") with experts is Mixtral."""
    if arch in (LLAMA, BAMBOO) and moe:
        return "mixtral"
    return {BAMBOO: "mistral", QWEN2: "qwen2", GEMMA3: "gemma3", OPT: "opt"}.get(arch, "llama")


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
