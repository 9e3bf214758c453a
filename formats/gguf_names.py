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

import numpy as np
from gguf import MODEL_TENSOR, GGUFWriter, RopeScalingType
from powerinfer_tools.formats import tensor_table
from powerinfer_tools.formats.constants import (
    FFN_ACTIVATION_KEY,
    PowerInferTensor,
    block_part,
    tensor_base_name,
    tensor_name,
)
from powerinfer_tools.formats.model_spec import FFNKind, FFNUnit, ModelSpec, NormKind
from powerinfer_tools.formats.tensor_table import TABLES, RopePairs, TensorRow

from powerinfer_tools.errors import PitoolsError

T = MODEL_TENSOR
LLAMA, OPT = tensor_table.LLAMA.gguf_architecture, tensor_table.OPT.gguf_architecture
QWEN2, GEMMA3 = tensor_table.QWEN2.gguf_architecture, tensor_table.GEMMA3.gguf_architecture
# What llama.cpp's gemma3 assumes rather than reads (src/llama-model.cpp, LLM_ARCH_GEMMA3): every 6th
# layer global, the sliding ones rotating with base 10000, queries scaled by 1/sqrt(head_dim) except in
# the 27B model (62 layers), whose scale is 1/sqrt(d_model / n_heads). A spec that differs has no GGUF layout.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_ROPE_LOCAL_THETA = 10000.0
GEMMA3_27B_LAYERS = 62


def gemma3_query_pre_attn_scalar(n_layers: int, d_model: int, n_heads: int, head_dim: int) -> float:
    """The query scaling llama.cpp's gemma3 computes with (see above)."""
    return d_model / n_heads if n_layers == GEMMA3_27B_LAYERS else head_dim
BAMBOO = "bamboo"  # PowerInfer's name for a dReLU LLaMA in its sparse layout (same tensors)
_NORMS = (T.ATTN_NORM, T.FFN_NORM, T.OUTPUT_NORM, T.ATTN_Q_NORM, T.ATTN_K_NORM, T.ATTN_POST_NORM, T.FFN_POST_NORM)
_ATTENTION = (T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.ATTN_OUT)
_FFN = (T.FFN_GATE, T.FFN_UP, T.FFN_DOWN)
_BLOCK = tensor_base_name(T.ATTN_NORM, 0).split(".")[0]  # "blk"
_PREDICTOR_PARTS = (block_part(PowerInferTensor.PREDICTOR_FC1), block_part(PowerInferTensor.PREDICTOR_FC2))


def gguf_architecture(spec: ModelSpec, powerinfer: bool) -> str:
    """llama.cpp's architecture name for ``spec`` in the dense or the PowerInfer layout: its table's.

    dReLU (symmetric-gate) LLaMA-family models are PowerInfer's "bamboo", which only its fork knows:
    in dense mode they are written as their table says ("llama"). Other architectures keep their name
    (a "bamboo" file is read back as LLaMA's table, whose rope order Qwen2's is not).
    """
    architecture = TABLES[spec.architecture].gguf_architecture
    if powerinfer and spec.ffn is FFNKind.DRELU and architecture == LLAMA:
        return BAMBOO
    return architecture


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
    offset: float = 0.0  # added to the values as stored (the table's norm_offset, on norm weights)

    @property
    def unit(self) -> FFNUnit:
        return FFNUnit(self.layer, self.expert)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        shape = self.shape[::-1] if self.transpose else self.shape
        return (len(self.sources),) + shape if self.stacked else shape


def check_supported(spec: ModelSpec) -> None:
    """Refuse model variants that have no GGUF layout in llama.cpp or PowerInfer."""
    if spec.architecture == "gemma3":
        _check_gemma3(spec)
    if spec.architecture != "opt":
        return
    if spec.embed_dim is not None or not spec.pre_norm or not spec.final_norm:
        raise PitoolsError(
            "OPT variants with post-LayerNorm blocks or projected embeddings (OPT-350m) have no GGUF layout "
            "in llama.cpp or PowerInfer; they cannot be converted"
        )
    if not spec.tied_embeddings:
        raise PitoolsError("OPT with an untied lm_head has no GGUF layout (PowerInfer's OPT reuses token_embd)")


def _check_gemma3(spec: ModelSpec) -> None:
    """llama.cpp's gemma3 reads the window but assumes the rest (GEMMA3_* above): a model that differs is refused."""
    expected = {"sliding_window_pattern": GEMMA3_SLIDING_WINDOW_PATTERN, "rope_local_theta": GEMMA3_ROPE_LOCAL_THETA,
                "query_pre_attn_scalar": gemma3_query_pre_attn_scalar(spec.n_layers, spec.d_model, spec.n_heads,
                                                                      spec.head_dim)}
    for field, value in expected.items():
        if getattr(spec, field) != value:
            raise PitoolsError(f"a gemma3 model with {field} {getattr(spec, field)} has no GGUF layout: llama.cpp's "
                               f"gemma3 assumes {value}")
    if spec.sliding_window is None:
        raise PitoolsError("a gemma3 model without a sliding window has no GGUF layout (llama.cpp's gemma3 needs one)")


def _shapes(spec: ModelSpec) -> dict[MODEL_TENSOR, tuple[int, ...]]:
    """Each tensor's shape in the checkpoint, as config.json implies it."""
    d, d_ff, vocab = spec.d_model, spec.d_ff, spec.vocab_size
    q_rows, kv_rows = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    return {
        T.TOKEN_EMBD: (vocab, d), T.POS_EMBD: (spec.max_positions + spec.position_offset, d),
        T.ATTN_NORM: (d,), T.ATTN_Q: (q_rows, d), T.ATTN_K: (kv_rows, d), T.ATTN_V: (kv_rows, d),
        T.ATTN_OUT: (d, q_rows), T.FFN_NORM: (d,), T.FFN_GATE: (d_ff, d), T.FFN_UP: (d_ff, d),
        T.FFN_DOWN: (d, d_ff), T.OUTPUT_NORM: (d,), T.OUTPUT: (vocab, d),
        # Gemma 3: q and k normed per head, norms after attention and the FFN
        T.ATTN_Q_NORM: (spec.head_dim,), T.ATTN_K_NORM: (spec.head_dim,), T.ATTN_POST_NORM: (d,),
        T.FFN_POST_NORM: (d,),
        # a mixture of experts: the router, and each expert's matrices (stacked in the file)
        T.FFN_GATE_INP: (spec.n_experts, d), T.FFN_GATE_EXP: (d_ff, d), T.FFN_UP_EXP: (d_ff, d),
        T.FFN_DOWN_EXP: (d, d_ff),
    }


def _has_bias(spec: ModelSpec, tensor: MODEL_TENSOR) -> bool:
    if tensor in _NORMS:
        return spec.norm is NormKind.LAYER  # LayerNorm has a bias, RMSNorm none
    if tensor in _ATTENTION:
        return spec.attention_bias and tensor in TABLES[spec.architecture].attention_biases
    return tensor in _FFN and spec.ffn_bias


def _rope_heads(spec: ModelSpec, tensor: MODEL_TENSOR) -> int:
    """Heads to regroup q/k rows by for llama.cpp's adjacent-pair rope; 0: stored as in the checkpoint."""
    if spec.rope_theta is None or TABLES[spec.architecture].rope_pairs is not RopePairs.ADJACENT:
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


def _row_names(row: TensorRow, layer: int | None, spec: ModelSpec, powerinfer: bool) -> list[TensorName]:
    """The weight (and bias) of one table row. PowerInfer's sparse axpy wants the down projection
    transposed, as ffn_down_t; a bias follows its weight's output rows (regrouped, never transposed)."""
    if powerinfer and row.per_expert:
        return _expert_names(row, layer, spec)
    shape, rope_heads = _shapes(spec)[row.tensor], _rope_heads(spec, row.tensor)
    transpose = powerinfer and row.tensor is T.FFN_DOWN
    target = PowerInferTensor.FFN_DOWN_T if transpose else row.tensor
    sources = (row.hf_name(layer),)
    if row.per_expert:
        sources = tuple(row.hf_name(layer, expert=e) for e in range(spec.n_experts))
    if row.tensor is T.OUTPUT and spec.tied_embeddings:
        # PowerInfer's loader requires output.weight, so tied models get a copy of the embedding.
        sources = (row_of(spec, T.TOKEN_EMBD).hf_name(),)
    offset = TABLES[spec.architecture].norm_offset if row.tensor in _NORMS else 0.0
    names = [TensorName(sources, tensor_name(target, layer), shape, transpose, rope_heads, layer, row.per_expert,
                        offset=offset)]
    if _has_bias(spec, row.tensor):
        names.append(TensorName((row.hf_name(layer, "bias"),), tensor_name(target, layer, "bias"), shape[:1],
                                rope_heads=rope_heads, layer=layer))
    return names


def row_of(spec: ModelSpec, tensor: MODEL_TENSOR) -> TensorRow:
    """The table row of ``tensor`` in ``spec``'s architecture."""
    return TABLES[spec.architecture].row(tensor)


def logits_tensor(targets) -> str:
    """Of a file's tensor names ``targets``, the one that computes the logits: ``output.weight``, or the shared
    embedding where there is none (OPT)."""
    output = tensor_name(MODEL_TENSOR.OUTPUT)
    return output if output in set(targets) else tensor_name(MODEL_TENSOR.TOKEN_EMBD)


def tensor_names(spec: ModelSpec, powerinfer: bool) -> list[TensorName]:
    """Every model tensor of ``spec`` in file order (predictors come from elsewhere)."""
    check_supported(spec)
    table = TABLES[spec.architecture]
    names = []
    for layer, rows in [(None, table.before)] + [(i, table.block) for i in range(spec.n_layers)] + [(None, table.after)]:
        for row in rows:
            if row.tensor is not None:  # a Hugging Face tensor without GGUF layout (refused above)
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
        if spec.rope_scaling_factor != 1.0:
            writer.add_rope_scaling_type(RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(spec.rope_scaling_factor)
    if spec.sliding_window is not None:
        writer.add_sliding_window(spec.sliding_window)  # gemma3: its sliding layers' (check_supported)
    if spec.moe:
        writer.add_expert_count(spec.n_experts)
        writer.add_expert_used_count(spec.n_experts_used)
    writer.add_string(FFN_ACTIVATION_KEY, spec.ffn.value)


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
