"""What each supported architecture is called in GGUF: the architecture string,
the tensor names and the metadata keys that llama.cpp (and PowerInfer's fork
of it) look for.

Sources: llama.cpp's ``convert_hf_to_gguf.py`` / ``src/models/llama.cpp`` for
dense LLaMA and Mistral, PowerInfer's ``convert.py``,
``convert-hf-to-powerinfer-gguf.py`` and ``llama.cpp`` for ``bamboo``, ``opt``
and the sparse layout. ``formats/README.md`` is the written specification.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGUFWriter, RopeScalingType

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.models.spec import FFNKind, ModelSpec, NormKind

LLAMA, BAMBOO, OPT = "llama", "bamboo", "opt"

# Our one metadata addition for the model itself: llama.cpp infers the FFN
# activation from the architecture (SiLU for dense "llama"), which is wrong for
# a ReLU model written in dense mode; our runtime reads the true one here.
FFN_ACTIVATION_KEY = "pitools.ffn_activation"


def neuron_frequency_key(layer: int) -> str:
    """Our key for a layer's profiled firing probability per neuron (float32 array, file order),
    which ``pitools solve`` places neurons by. PowerInfer ignores it."""
    return f"pitools.blk.{layer}.neuron_frequency"


def gguf_architecture(spec: ModelSpec, powerinfer: bool) -> str:
    """llama.cpp's architecture name for ``spec`` in the dense or the PowerInfer layout.

    Mistral is "llama" to llama.cpp. dReLU (symmetric-gate) models are PowerInfer's
    "bamboo", which only its fork knows: in dense mode they are written as "llama".
    """
    if spec.architecture == "opt":
        return OPT
    if powerinfer and spec.ffn is FFNKind.DRELU:
        return BAMBOO
    return LLAMA


@dataclass(frozen=True)
class TensorName:
    """One checkpoint tensor and where it goes in the GGUF file."""

    source: str  # Hugging Face name in the checkpoint
    target: str  # GGUF name
    shape: tuple[int, ...]  # shape in the checkpoint, as config.json implies it
    transpose: bool = False  # stored transposed: PowerInfer's neuron-major ffn_down_t
    rope_heads: int = 0  # > 0: rows regrouped per head into llama.cpp's rotary pair order

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return self.shape[::-1] if self.transpose else self.shape


def check_supported(spec: ModelSpec) -> None:
    """Refuse model variants that have no GGUF layout in llama.cpp or PowerInfer."""
    if spec.architecture != "opt":
        return
    if spec.embed_dim is not None or not spec.pre_norm or not spec.final_norm:
        raise PitoolsError(
            "OPT variants with post-LayerNorm blocks or projected embeddings (OPT-350m) have no GGUF layout "
            "in llama.cpp or PowerInfer; they cannot be converted"
        )
    if not spec.tied_embeddings:
        raise PitoolsError("OPT with an untied lm_head has no GGUF layout (PowerInfer's OPT reuses token_embd)")


def _linear(
    source: str, target: str, shape: tuple[int, int], bias: bool, *, transpose: bool = False, rope_heads: int = 0
) -> list[TensorName]:
    names = [TensorName(f"{source}.weight", f"{target}.weight", shape, transpose, rope_heads)]
    if bias:  # a bias follows its weight's output rows: regrouped with them, never transposed
        names.append(TensorName(f"{source}.bias", f"{target}.bias", (shape[0],), rope_heads=rope_heads))
    return names


def _norm(source: str, target: str, width: int, bias: bool) -> list[TensorName]:
    names = [TensorName(f"{source}.weight", f"{target}.weight", (width,))]
    if bias:
        names.append(TensorName(f"{source}.bias", f"{target}.bias", (width,)))
    return names


def _down(source: str, block: str, spec: ModelSpec, powerinfer: bool) -> list[TensorName]:
    """The down projection: as is in dense mode, transposed to ``ffn_down_t`` for PowerInfer's sparse axpy."""
    target = f"{block}.ffn_down_t" if powerinfer else f"{block}.ffn_down"
    return _linear(source, target, (spec.d_model, spec.d_ff), spec.ffn_bias, transpose=powerinfer)


def _llama_tensors(spec: ModelSpec, powerinfer: bool) -> list[TensorName]:
    d, d_ff = spec.d_model, spec.d_ff
    q_rows, kv_rows = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    names = [TensorName("model.embed_tokens.weight", "token_embd.weight", (spec.vocab_size, d))]
    bias = spec.attention_bias
    for i in range(spec.n_layers):
        src, dst = f"model.layers.{i}", f"blk.{i}"
        names += _norm(f"{src}.input_layernorm", f"{dst}.attn_norm", d, bias=False)
        names += _linear(f"{src}.self_attn.q_proj", f"{dst}.attn_q", (q_rows, d), bias, rope_heads=spec.n_heads)
        names += _linear(f"{src}.self_attn.k_proj", f"{dst}.attn_k", (kv_rows, d), bias, rope_heads=spec.n_kv_heads)
        names += _linear(f"{src}.self_attn.v_proj", f"{dst}.attn_v", (kv_rows, d), bias)
        names += _linear(f"{src}.self_attn.o_proj", f"{dst}.attn_output", (d, q_rows), bias)
        names += _norm(f"{src}.post_attention_layernorm", f"{dst}.ffn_norm", d, bias=False)
        names += _linear(f"{src}.mlp.gate_proj", f"{dst}.ffn_gate", (d_ff, d), spec.ffn_bias)
        names += _linear(f"{src}.mlp.up_proj", f"{dst}.ffn_up", (d_ff, d), spec.ffn_bias)
        names += _down(f"{src}.mlp.down_proj", dst, spec, powerinfer)
    names += _norm("model.norm", "output_norm", d, bias=False)
    # PowerInfer's loader requires output.weight, so tied models get a copy of the embedding.
    head = "model.embed_tokens.weight" if spec.tied_embeddings else "lm_head.weight"
    names.append(TensorName(head, "output.weight", (spec.vocab_size, d)))
    return names


def _opt_tensors(spec: ModelSpec, powerinfer: bool) -> list[TensorName]:
    d, bias = spec.d_model, spec.attention_bias
    names = [
        TensorName("model.decoder.embed_tokens.weight", "token_embd.weight", (spec.vocab_size, d)),
        # The whole learned table, including OPT's two leading offset rows.
        TensorName(
            "model.decoder.embed_positions.weight", "position_embd.weight", (spec.max_positions + spec.position_offset, d)
        ),
    ]
    for i in range(spec.n_layers):
        src, dst = f"model.decoder.layers.{i}", f"blk.{i}"
        names += _norm(f"{src}.self_attn_layer_norm", f"{dst}.attn_norm", d, bias=True)
        names += _linear(f"{src}.self_attn.q_proj", f"{dst}.attn_q", (d, d), bias)
        names += _linear(f"{src}.self_attn.k_proj", f"{dst}.attn_k", (d, d), bias)
        names += _linear(f"{src}.self_attn.v_proj", f"{dst}.attn_v", (d, d), bias)
        names += _linear(f"{src}.self_attn.out_proj", f"{dst}.attn_output", (d, d), bias)
        names += _norm(f"{src}.final_layer_norm", f"{dst}.ffn_norm", d, bias=True)
        names += _linear(f"{src}.fc1", f"{dst}.ffn_up", (spec.d_ff, d), spec.ffn_bias)
        names += _down(f"{src}.fc2", dst, spec, powerinfer)
    names += _norm("model.decoder.final_layer_norm", "output_norm", d, bias=True)
    return names


def tensor_names(spec: ModelSpec, powerinfer: bool) -> list[TensorName]:
    """Every model tensor of ``spec`` in file order (predictors come from elsewhere)."""
    check_supported(spec)
    return _opt_tensors(spec, powerinfer) if spec.architecture == "opt" else _llama_tensors(spec, powerinfer)


def predictor_names(layer: int) -> tuple[str, str]:
    """PowerInfer's predictor tensors of one layer: fc1 [hidden, n_embd] and fc2 [n_ff, hidden]."""
    return f"blk.{layer}.fc1.weight", f"blk.{layer}.fc2.weight"


def rope_row_order(n_rows: int, n_heads: int) -> np.ndarray:
    """Row order that turns Hugging Face's rotary layout into llama.cpp's.

    Hugging Face rotates dimensions ``(i, i + head_dim/2)`` of each head together,
    llama.cpp's "normal" rope rotates ``(2i, 2i + 1)``: stored row ``2i + j`` of a
    head is checkpoint row ``i + j * head_dim/2``. Applied to q and k (weights and
    biases), it leaves attention scores unchanged.
    """
    half = n_rows // n_heads // 2
    return np.arange(n_rows).reshape(n_heads, 2, half).swapaxes(1, 2).reshape(-1)


def add_hyperparameters(writer: GGUFWriter, spec: ModelSpec) -> None:
    """The ``{arch}.*`` keys llama.cpp reads, through gguf-py's typed helpers."""
    writer.add_context_length(spec.max_positions)
    writer.add_embedding_length(spec.d_model)
    writer.add_block_count(spec.n_layers)
    writer.add_feed_forward_length(spec.d_ff)
    writer.add_head_count(spec.n_heads)
    writer.add_head_count_kv(spec.n_kv_heads)
    writer.add_vocab_size(spec.vocab_size)
    if spec.norm is NormKind.RMS:
        writer.add_layer_norm_rms_eps(spec.norm_eps)
    else:
        writer.add_layer_norm_eps(spec.norm_eps)
    if spec.rope_theta is not None:
        writer.add_rope_dimension_count(spec.head_dim)
        writer.add_rope_freq_base(spec.rope_theta)
        if spec.head_dim != spec.d_model // spec.n_heads:
            writer.add_key_length(spec.head_dim)
            writer.add_value_length(spec.head_dim)
        if spec.rope_scaling_factor != 1.0:
            writer.add_rope_scaling_type(RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(spec.rope_scaling_factor)
    if spec.sliding_window is not None:
        writer.add_sliding_window(spec.sliding_window)
    writer.add_string(FFN_ACTIVATION_KEY, spec.ffn.value)


def tensor_kind(name: str) -> str:
    """What part of the model a GGUF tensor belongs to: embedding, attention, ffn, predictor, output or other."""
    if name.startswith(("token_embd.", "position_embd.")):
        return "embedding"
    if name.startswith(("output.", "output_norm.")):
        return "output"
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) > 2:
        if parts[2].startswith("attn_"):
            return "attention"
        if parts[2].startswith("ffn_"):
            return "ffn"
        if parts[2] in ("fc1", "fc2"):
            return "predictor"
    return "other"
