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

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.models.opt import POSITION_OFFSET
from powerinfer_tools.models.spec import FFNKind, ModelSpec, NormKind, spec_errors_named

from .gguf_names import BAMBOO, FFN_ACTIVATION_KEY, LLAMA, OPT
from .model_file import ModelFile

SUPPORTED_ARCHITECTURES = (LLAMA, BAMBOO, OPT)

# ModelSpec fields -> the metadata keys they are read from ({arch}: the architecture).
METADATA_KEYS = {
    "n_layers": "{arch}.block_count",
    "d_model": "{arch}.embedding_length",
    "n_heads": "{arch}.attention.head_count",
    "n_kv_heads": "{arch}.attention.head_count_kv",
    "head_dim": "{arch}.attention.key_length",
    "d_ff": "{arch}.feed_forward_length",
    "vocab_size": "{arch}.vocab_size",
    "max_positions": "{arch}.context_length",
    "rope_theta": "{arch}.rope.freq_base",
    "rope_scaling_factor": "{arch}.rope.scaling.factor",
    "sliding_window": "{arch}.attention.sliding_window",
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
    "ffn": FFN_ACTIVATION_KEY,
}
TOKENS_KEY = "tokenizer.ggml.tokens"


def _metadata_keys(arch: str) -> dict[str, str]:
    keys = {field: key.format(arch=arch) for field, key in METADATA_KEYS.items()}
    keys["norm_eps"] = f"{arch}.attention.layer_norm_epsilon" if arch == OPT else f"{arch}.attention.layer_norm_rms_epsilon"
    return keys


def _ffn_kind(model: ModelFile) -> FFNKind:
    stored = model.get(FFN_ACTIVATION_KEY)
    if stored is not None:
        try:
            return FFNKind(stored)
        except ValueError:
            kinds = ", ".join(kind.value for kind in FFNKind)
            raise PitoolsError(f"{FFN_ACTIVATION_KEY} is {stored!r:.60}; expected one of {kinds}") from None
    if model.architecture == BAMBOO:
        return FFNKind.DRELU
    if model.architecture == OPT:
        return FFNKind.RELU
    return FFNKind.REGLU if model.powerinfer else FFNKind.SWIGLU


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
    linear_rope = model.get("{arch}.rope.scaling.type", "none") == "linear"
    return ModelSpec(
        architecture="opt" if is_opt else ("mistral" if arch == BAMBOO else "llama"),
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
        tied_embeddings="output.weight" not in model,
        rope_theta=None if is_opt else value("rope_theta", 10000.0),
        rope_scaling_factor=value("rope_scaling_factor", 1.0) if linear_rope else 1.0,
        sliding_window=value("sliding_window"),
        attention_bias="blk.0.attn_q.bias" in model,
        ffn_bias="blk.0.ffn_up.bias" in model,
        position_offset=POSITION_OFFSET if is_opt else 0,
        bos_token_id=value("bos_token_id"),
        eos_token_id=value("eos_token_id"),
    )


def _token_count(model: ModelFile, vocab_key: str) -> int:
    """The vocabulary size of a file without ``{arch}.vocab_size``: its token list's length."""
    tokens = model.get(TOKENS_KEY)
    if not isinstance(tokens, list):
        raise PitoolsError(f"metadata lacks {vocab_key}, and {TOKENS_KEY} is no array to count instead")
    return len(tokens)
