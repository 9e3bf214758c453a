"""What each supported architecture is called in GGUF: the architecture string,
the tensor names and the metadata keys that llama.cpp (and PowerInfer's fork
of it) look for.

Sources: llama.cpp's ``convert_hf_to_gguf.py`` / ``src/models/llama.cpp`` for
dense LLaMA and Mistral (``src/models/qwen2.cpp`` for Qwen2), PowerInfer's ``convert.py``,
``convert-hf-to-powerinfer-gguf.py`` and ``llama.cpp`` for ``bamboo``, ``opt``
and the sparse layout. ``formats/README.md`` is the written specification.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
from gguf import MODEL_TENSOR, GGUFWriter, RopeScalingType
from powerinfer_tools.formats.architecture import RopePairs, TensorRow, fused_rows
from powerinfer_tools.formats.constants import (
    FFN_ACTIVATION_KEY,
    PowerInferTensor,
    block_part,
    tensor_base_name,
    tensor_name,
)
from powerinfer_tools.formats.model_file import StoredTensor
from powerinfer_tools.formats.model_spec import FFNKind, FFNUnit, ModelSpec, NormKind
from powerinfer_tools.formats.rope import RopeKind, RopeScaling

T = MODEL_TENSOR
_NORMS = (T.ATTN_NORM, T.FFN_NORM, T.OUTPUT_NORM, T.ATTN_Q_NORM, T.ATTN_K_NORM, T.ATTN_POST_NORM, T.FFN_POST_NORM)
_ATTENTION = (T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.ATTN_OUT)
_FFN = (T.FFN_GATE, T.FFN_UP, T.FFN_DOWN)
_BLOCK = tensor_base_name(T.ATTN_NORM, 0).split(".")[0]  # "blk"
_PREDICTOR_PARTS = (block_part(PowerInferTensor.PREDICTOR_FC1), block_part(PowerInferTensor.PREDICTOR_FC2))


def gguf_architecture(spec: ModelSpec, powerinfer: bool) -> str:
    """llama.cpp's architecture name for ``spec`` in the dense or the PowerInfer layout: its family's.

    dReLU (symmetric-gate) models of a family PowerInfer names otherwise then (its "bamboo", a dReLU LLaMA) are
    written so in its sparse layout, which only PowerInfer's fork knows; in dense mode as their family's name.
    """
    drelu_name = spec.architecture.powerinfer_drelu_name
    if powerinfer and spec.ffn is FFNKind.DRELU and drelu_name is not None:
        return drelu_name
    return spec.architecture.gguf_name


@dataclass(frozen=True)
class TensorName:
    """One GGUF tensor and the checkpoint tensor(s) it is made of."""

    sources: tuple[str, ...]  # Hugging Face name(s) in the checkpoint: one, or each expert's for a stacked tensor
    target: str  # GGUF name
    shape: tuple[int, ...]  # shape of each source in the checkpoint, as config.json implies it
    transpose: bool = False  # stored transposed: PowerInfer's neuron-major ffn_down_t
    rope_heads: int = 0  # > 0: rows regrouped per head into llama.cpp's rotary pair order
    layer: int | None = None  # the block it belongs to; None: a global tensor
    stacked: bool = False  # a mixture's experts, stacked along a new first axis (ffn_up_exps ...)
    expert: int | None = None  # one expert's own tensor (a mixture's sparse layout: blk.N.ffn_up.X)
    offset: float = 0.0  # added to the values as stored (the family's norm_offset, on norm weights)
    # A part of a fused checkpoint tensor (Phi-3's qkv_proj), written as a tensor of its own: its rows there,
    # and the fused tensor's shape.
    source_rows: slice | None = None
    source_shape: tuple[int, ...] | None = None
    values: tuple[float, ...] | None = None  # a tensor the checkpoint does not hold: made from config.json

    @property
    def unit(self) -> FFNUnit:
        return FFNUnit(self.layer, self.expert)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        shape = self.shape[::-1] if self.transpose else self.shape
        return (len(self.sources),) + shape if self.stacked else shape

    @property
    def checkpoint_shape(self) -> tuple[int, ...]:
        """The shape of each source tensor in the checkpoint."""
        return self.source_shape or self.shape


def _shapes(spec: ModelSpec) -> dict[MODEL_TENSOR, tuple[int, ...]]:
    """Each tensor's shape in the checkpoint, as config.json implies it."""
    d, d_ff, vocab = spec.d_model, spec.d_ff, spec.vocab_size
    q_rows, kv_rows = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    return {
        T.TOKEN_EMBD: (vocab, d), T.POS_EMBD: (spec.max_positions + spec.position_offset, d),
        T.ATTN_NORM: (d,), T.ATTN_Q: (q_rows, d), T.ATTN_K: (kv_rows, d), T.ATTN_V: (kv_rows, d),
        T.ATTN_OUT: (d, q_rows), T.FFN_NORM: (d,), T.FFN_GATE: (d_ff, d), T.FFN_UP: (d_ff, d),
        T.FFN_DOWN: (d, d_ff), T.OUTPUT_NORM: (d,), T.OUTPUT: (vocab, d),
        # q and k normed per head (Qwen3, Gemma 3), norms after attention and the FFN (Gemma 3)
        T.ATTN_Q_NORM: (spec.head_dim,), T.ATTN_K_NORM: (spec.head_dim,), T.ATTN_POST_NORM: (d,),
        T.FFN_POST_NORM: (d,),
        # a mixture of experts: the router, and each expert's matrices (stacked in the file)
        T.FFN_GATE_INP: (spec.n_experts, d), T.FFN_GATE_EXP: (d_ff, d), T.FFN_UP_EXP: (d_ff, d),
        T.FFN_DOWN_EXP: (d, d_ff),
    }


def part_rows(spec: ModelSpec, row: TensorRow, tensor: MODEL_TENSOR) -> slice:
    """Where ``tensor``'s rows lie in ``row``'s tensor: all of it, or its part of a fused tensor."""
    shapes = _shapes(spec)
    return fused_rows(row, tensor, lambda part: shapes[part][0])


def checkpoint_shape(spec: ModelSpec, row: TensorRow) -> tuple[int, ...]:
    """The shape of ``row``'s tensor in the checkpoint (and a dense GGUF file): its own, or a fused tensor's, its
    parts' rows one after the other."""
    if not row.parts:
        return _shapes(spec)[row.tensor]
    shapes = [_shapes(spec)[part] for part in row.parts]
    return (sum(shape[0] for shape in shapes),) + shapes[0][1:]


def _has_bias(spec: ModelSpec, tensor: MODEL_TENSOR) -> bool:
    if tensor in _NORMS:
        return spec.norm is NormKind.LAYER  # LayerNorm has a bias, RMSNorm none
    if tensor in _ATTENTION:
        return spec.attention_bias and tensor in spec.architecture.attention_biases
    return tensor in _FFN and spec.ffn_bias


def _rope_heads(spec: ModelSpec, tensor: MODEL_TENSOR) -> int:
    """Heads to regroup q/k rows by for llama.cpp's adjacent-pair rope; 0: stored as in the checkpoint."""
    if spec.rope_theta is None or spec.architecture.rope_pairs is not RopePairs.ADJACENT:
        return 0
    return {T.ATTN_Q: spec.n_heads, T.ATTN_K: spec.n_kv_heads}.get(tensor, 0)


# A mixture's experts in the sparse layout: each expert's matrices are its own tensors, named as a
# layer's FFN in PowerInfer's layout with the expert's index after them (formats/README.md).
_EXPERT_TENSORS = {T.FFN_GATE_EXP: T.FFN_GATE, T.FFN_UP_EXP: T.FFN_UP, T.FFN_DOWN_EXP: PowerInferTensor.FFN_DOWN_T}


def _expert_names(row: TensorRow, layer: int, spec: ModelSpec) -> list[TensorName]:
    """One expert tensor row in the sparse layout: each expert's own, the down projection transposed."""
    target = _EXPERT_TENSORS[row.tensor]
    return [TensorName((row.hf_name(layer, expert=e),), tensor_name(target, layer, expert=e), _shapes(spec)[row.tensor],
                       transpose=row.tensor is T.FFN_DOWN_EXP, layer=layer, expert=e)
            for e in range(spec.n_experts)]


def _part_names(row: TensorRow, layer: int, spec: ModelSpec) -> list[TensorName]:
    """A fused row in the sparse layout: each part a tensor of its own (a neuron's gate and up rows are
    reordered, chosen and read apart; llama.cpp reads no sparse file). Fused rows carry no biases."""
    return [TensorName((row.hf_name(layer),), tensor_name(part, layer), _shapes(spec)[part],
                       rope_heads=_rope_heads(spec, part), layer=layer, source_rows=part_rows(spec, row, part),
                       source_shape=checkpoint_shape(spec, row))
            for part in row.parts]


def _row_names(row: TensorRow, layer: int | None, spec: ModelSpec, powerinfer: bool) -> list[TensorName]:
    """The weight (and bias) of one row. PowerInfer's sparse axpy wants the down projection transposed, as
    ffn_down_t; a bias follows its weight's output rows (regrouped, never transposed). A fused row is one tensor
    in the dense layout, as llama.cpp's converter writes it (its parts rotate halves: no rows regrouped)."""
    if powerinfer and row.per_expert:
        return _expert_names(row, layer, spec)
    if row.parts:
        if powerinfer:
            return _part_names(row, layer, spec)
        return [TensorName((row.hf_name(layer),), tensor_name(row.tensor, layer), checkpoint_shape(spec, row),
                           layer=layer)]
    shape, rope_heads = _shapes(spec)[row.tensor], _rope_heads(spec, row.tensor)
    transpose = powerinfer and row.tensor is T.FFN_DOWN
    target = PowerInferTensor.FFN_DOWN_T if transpose else row.tensor
    sources = (row.hf_name(layer),)
    if row.per_expert:
        sources = tuple(row.hf_name(layer, expert=e) for e in range(spec.n_experts))
    if row.tensor is T.OUTPUT and spec.tied_embeddings:
        # PowerInfer's loader requires output.weight, so tied models get a copy of the embedding.
        sources = (row_of(spec, T.TOKEN_EMBD).hf_name(),)
    offset = spec.architecture.norm_offset if row.tensor in _NORMS else 0.0
    names = [TensorName(sources, tensor_name(target, layer), shape, transpose, rope_heads, layer, row.per_expert,
                        offset=offset)]
    if _has_bias(spec, row.tensor):
        names.append(TensorName((row.hf_name(layer, "bias"),), tensor_name(target, layer, "bias"), shape[:1],
                                rope_heads=rope_heads, layer=layer))
    return names


def fused_parts(spec: ModelSpec, stored: Mapping[str, StoredTensor]) -> dict[str, StoredTensor]:
    """The parts of a dense file's fused tensors (Phi-3's attn_qkv; its gate and up in one ffn_up) as tensors of
    their own, each a view of its rows of the fused one: what the runtime computes with. (A sparse file stores
    them apart already: ``_part_names``.)"""
    parts = {}
    for layer in range(spec.n_layers):
        for row in spec.architecture.block:
            fused = tensor_name(row.tensor, layer) if row.parts else None
            if fused not in stored or any(tensor_name(p, layer) in stored for p in row.parts if p is not row.tensor):
                continue
            t = stored[fused]
            for part in row.parts:
                rows = part_rows(spec, row, part)
                parts[tensor_name(part, layer)] = StoredTensor(
                    tensor_name(part, layer), t.qtype, (rows.stop - rows.start,) + t.shape[1:], t.data[rows],
                    t.offset + rows.start * (t.nbytes // t.shape[0]))
    return parts


def _rope_frequency_factors(spec: ModelSpec) -> list[TensorName]:
    """Llama 3.1's and longrope's rotary scalings, as llama.cpp's converter stores them: one divisor per rotation
    pair in a tensor (longrope: a tensor per list, the long one first)."""
    scaling = spec.rope_scaling
    lists = {RopeKind.LLAMA3: ((T.ROPE_FREQS, scaling.frequency_factors),),
             RopeKind.LONGROPE: ((T.ROPE_FACTORS_LONG, scaling.long_factors),
                                 (T.ROPE_FACTORS_SHORT, scaling.short_factors))}.get(scaling.kind, ())
    return [TensorName((), tensor_name(tensor), (len(factors),), values=factors) for tensor, factors in lists]


def row_of(spec: ModelSpec, tensor: MODEL_TENSOR) -> TensorRow:
    """The row of ``tensor`` in ``spec``'s architecture."""
    return spec.architecture.row(tensor)


def logits_tensor(targets) -> str:
    """Of a file's tensor names ``targets``, the one that computes the logits: ``output.weight``, or the shared
    embedding where there is none (OPT)."""
    output = tensor_name(MODEL_TENSOR.OUTPUT)
    return output if output in set(targets) else tensor_name(MODEL_TENSOR.TOKEN_EMBD)


def tensor_names(spec: ModelSpec, powerinfer: bool) -> list[TensorName]:
    """Every model tensor of ``spec`` in file order (predictors come from elsewhere); a spec that llama.cpp's
    architecture cannot hold is refused (``Architecture.check_layout``)."""
    arch = spec.architecture
    arch.check_layout(spec)
    names = _rope_frequency_factors(spec)
    for layer, rows in [(None, arch.before)] + [(i, arch.block) for i in range(spec.n_layers)] + [(None, arch.after)]:
        for row in rows:
            if row.tensor is not None:  # a Hugging Face tensor without GGUF layout (refused by check_layout)
                names += _row_names(row, layer, spec, powerinfer)
    return names


def rope_row_order(n_rows: int, n_heads: int) -> np.ndarray:
    """Row order that turns Hugging Face's rotary layout into llama.cpp's "normal" (adjacent-pair) one.

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
        _add_rope_scaling(writer, spec.rope_scaling)
    if spec.sliding_window is not None:
        writer.add_sliding_window(spec.sliding_window)  # gemma2, gemma3: their sliding layers' (their check_layout)
    if spec.attn_logit_softcapping is not None:  # gemma2 (its check_layout: always capped)
        writer.add_attn_logit_softcapping(spec.attn_logit_softcapping)
        writer.add_final_logit_softcapping(spec.final_logit_softcapping)
    if spec.moe:
        writer.add_expert_count(spec.n_experts)
        writer.add_expert_used_count(spec.n_experts_used)
    writer.add_string(FFN_ACTIVATION_KEY, spec.ffn.value)


def _add_rope_scaling(writer: GGUFWriter, scaling: RopeScaling) -> None:
    """The rope.scaling.* keys as llama.cpp's converter writes them (llama3's factors and longrope's are tensors:
    ``tensor_names``)."""
    if scaling.kind is RopeKind.LINEAR:
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling.factor)
    elif scaling.kind is RopeKind.YARN:
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling.factor)
        writer.add_rope_scaling_orig_ctx_len(scaling.original_context)
    elif scaling.kind is RopeKind.LONGROPE:  # no type key: llama.cpp reads longrope from its tensors
        writer.add_rope_scaling_attn_factors(scaling.attention_factor)
        writer.add_rope_scaling_orig_ctx_len(scaling.original_context)


def tensor_kind(name: str) -> str:
    """What part of the model a GGUF tensor belongs to: embedding, attention, ffn, predictor, output or other."""
    if name.startswith(_prefixes(T.TOKEN_EMBD, T.POS_EMBD)):
        return "embedding"
    if name.startswith(_prefixes(T.OUTPUT, T.OUTPUT_NORM)):
        return "output"
    parts = name.split(".")
    if parts[0] == _BLOCK and len(parts) > 2:
        if parts[2].startswith("attn_"):
            return "attention"
        if parts[2].startswith("ffn_"):
            return "ffn"
        if parts[2] in _PREDICTOR_PARTS:
            return "predictor"
    return "other"


def _prefixes(*tensors: MODEL_TENSOR) -> tuple[str, ...]:
    return tuple(tensor_base_name(tensor) + "." for tensor in tensors)
