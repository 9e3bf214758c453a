"""The ``ModelSpec`` of a model file, read back from its GGUF metadata.

This is the inverse of ``gguf_names.add_hyperparameters``. Files written by other
tools lack our ``pitools.ffn_activation`` key; their activation then follows
from the architecture the way PowerInfer's runtime decides it: ``bamboo`` is
dReLU, ``opt`` ReLU, a sparse (PowerInfer) ``llama`` file ReGLU and a dense
``llama`` file SwiGLU.
"""

from __future__ import annotations

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.models.opt import POSITION_OFFSET
from powerinfer_tools.models.spec import FFNKind, ModelSpec, NormKind

from .gguf_names import BAMBOO, FFN_ACTIVATION_KEY, LLAMA, OPT
from .model_file import ModelFile


def _ffn_kind(model: ModelFile) -> FFNKind:
    stored = model.get(FFN_ACTIVATION_KEY)
    if stored is not None:
        return FFNKind(stored)
    if model.architecture == BAMBOO:
        return FFNKind.DRELU
    if model.architecture == OPT:
        return FFNKind.RELU
    return FFNKind.REGLU if model.powerinfer else FFNKind.SWIGLU


def spec_from_model_file(model: ModelFile) -> ModelSpec:
    arch = model.architecture
    if arch not in (LLAMA, BAMBOO, OPT):
        raise PitoolsError(f"{model.path}: architecture {arch!r} is not supported (supported: {LLAMA}, {BAMBOO}, {OPT})")

    def need(key: str):
        value = model.get(key)
        if value is None:
            raise PitoolsError(f"{model.path}: metadata lacks {key.format(arch=arch)}")
        return value

    d_model = int(need("{arch}.embedding_length"))
    n_heads = int(need("{arch}.attention.head_count"))
    is_opt = arch == OPT
    rope_type = model.get("{arch}.rope.scaling.type", "none")
    return ModelSpec(
        architecture="opt" if is_opt else ("mistral" if arch == BAMBOO else "llama"),
        n_layers=int(need("{arch}.block_count")),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(model.get("{arch}.attention.head_count_kv", n_heads)),
        head_dim=int(model.get("{arch}.attention.key_length", d_model // n_heads)),
        d_ff=int(need("{arch}.feed_forward_length")),
        vocab_size=int(model.get("{arch}.vocab_size") or len(need("tokenizer.ggml.tokens"))),
        max_positions=int(need("{arch}.context_length")),
        norm=NormKind.LAYER if is_opt else NormKind.RMS,
        norm_eps=float(need("{arch}.attention.layer_norm_epsilon" if is_opt else "{arch}.attention.layer_norm_rms_epsilon")),
        ffn=_ffn_kind(model),
        tied_embeddings="output.weight" not in model,
        rope_theta=None if is_opt else float(model.get("{arch}.rope.freq_base", 10000.0)),
        rope_scaling_factor=float(model.get("{arch}.rope.scaling.factor", 1.0)) if rope_type == "linear" else 1.0,
        sliding_window=model.get("{arch}.attention.sliding_window"),
        attention_bias="blk.0.attn_q.bias" in model,
        ffn_bias="blk.0.ffn_up.bias" in model,
        position_offset=POSITION_OFFSET if is_opt else 0,
        bos_token_id=model.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=model.get("tokenizer.ggml.eos_token_id"),
    )
