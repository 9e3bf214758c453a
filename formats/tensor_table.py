"""One table per architecture: which Hugging Face tensor is which GGUF tensor, and its neuron axis.

In the spirit of gguf-py's ``tensor_mapping.py``: each row pairs a GGUF tensor
(``gguf.MODEL_TENSOR``, spelled by ``gguf.TENSOR_NAMES``) with the checkpoint's
name for it (``{bid}``: the block). The reference engine's loader, the
converter, the runtime's loader, the solver's statistics, the neuron reorder
and the synthetic checkpoints all name tensors through these rows, so adding an
architecture is one model module plus one entry in ``TABLES``.

A mixture-of-experts family fits the same shape: a row for the router
(``MODEL_TENSOR.FFN_GATE_INP``) and rows whose Hugging Face name also has an
``{xid}`` (the expert) for ``MODEL_TENSOR.FFN_GATE_EXP`` and friends, which GGUF
stores stacked as ``blk.N.ffn_gate_exps``.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from gguf import MODEL_TENSOR
from powerinfer_tools.formats.constants import PowerInferTensor, TensorKind, tensor_name

T = MODEL_TENSOR


@dataclass(frozen=True)
class TensorRow:
    """A tensor of the architecture: its GGUF kind and its Hugging Face name."""

    tensor: MODEL_TENSOR | None  # None: a Hugging Face tensor that has no GGUF layout (OPT-350m's projections)
    hf: str  # the checkpoint's name without ".weight"/".bias"; "{bid}": the block, "{xid}": the expert
    neuron_axis: int | None = None  # the axis of the checkpoint weight that indexes FFN neurons

    def hf_name(self, layer: int | None = None, part: str = "weight", expert: int | None = None) -> str:
        return f"{self.hf.format(bid=layer, xid=expert)}.{part}"

    @property
    def per_expert(self) -> bool:
        """One checkpoint tensor per expert, stacked into one GGUF tensor."""
        return "{xid}" in self.hf


class RopePairs(str, enum.Enum):
    """Which dimensions of a head llama.cpp rotates together, and so how a GGUF file stores q and k.

    Hugging Face rotates ``(i, i + head_dim/2)`` (rotate-half). llama.cpp picks a rope type per
    architecture: "normal" rotates ``(2i, 2i + 1)``, so its converter regroups q/k rows for it
    (``gguf_names.rope_row_order``); "neox" rotates Hugging Face's halves, rows left as they are.
    """

    ADJACENT = "adjacent"  # llama.cpp's LLAMA_ROPE_TYPE_NORM: LLaMA, Mistral, Mixtral
    HALVES = "halves"  # LLAMA_ROPE_TYPE_NEOX: Qwen2, Gemma 3


@dataclass(frozen=True)
class ArchitectureTable:
    """The rows of one architecture in GGUF file order: before the blocks, per block, after them."""

    gguf_architecture: str  # llama.cpp's name for it (general.architecture)
    before: tuple[TensorRow, ...]
    block: tuple[TensorRow, ...]
    after: tuple[TensorRow, ...]
    # The rotary pairs llama.cpp's architecture rotates (the rows of q and k follow); unused without RoPE.
    rope_pairs: RopePairs = RopePairs.ADJACENT
    # The attention projections that carry a bias in a model with ModelSpec.attention_bias.
    attention_biases: tuple[MODEL_TENSOR, ...] = (T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.ATTN_OUT)
    # What GGUF adds to the checkpoint's RMSNorm weights: Gemma's norms scale by (1 + w), and llama.cpp's
    # converter stores 1 + w so that its plain RMSNorm computes them.
    norm_offset: float = 0.0
    # Token embeddings multiplied by sqrt(d_model) before the first layer (Gemma).
    scaled_embeddings: bool = False

    def has(self, tensor: MODEL_TENSOR) -> bool:
        """Whether the architecture has a row for ``tensor``."""
        return any(row.tensor is tensor for row in self.before + self.block + self.after)

    def row(self, tensor: MODEL_TENSOR | None, hf: str | None = None) -> TensorRow:
        """The row of ``tensor`` (for a tensor with no GGUF layout, the one whose name ends in ``hf``)."""
        for row in self.before + self.block + self.after:
            if row.tensor is tensor and (hf is None or row.hf.endswith(hf)):
                return row
        raise KeyError(f"the architecture has no tensor {tensor.name if tensor else hf}")

    def hf_name(self, tensor: MODEL_TENSOR, layer: int | None = None, part: str = "weight",
                expert: int | None = None) -> str:
        """The checkpoint's name for ``tensor``: ``hf_name(FFN_UP, 3)`` is ``model.layers.3.mlp.up_proj.weight``."""
        return self.row(tensor).hf_name(layer, part, expert)

    def neuron_rows(self) -> tuple[TensorRow, ...]:
        """The block's FFN tensors, which are indexed by neuron along their ``neuron_axis``."""
        return tuple(row for row in self.block if row.neuron_axis is not None)


def _block(prefix: str, *rows: tuple[MODEL_TENSOR, str, int | None]) -> tuple[TensorRow, ...]:
    """A block's rows: (GGUF tensor, Hugging Face name below ``prefix``, neuron axis)."""
    return tuple(TensorRow(tensor, prefix + hf, axis) for tensor, hf, axis in rows)


LLAMA = ArchitectureTable(
    gguf_architecture="llama",
    before=(TensorRow(T.TOKEN_EMBD, "model.embed_tokens"),),
    block=_block(
        "model.layers.{bid}.",
        (T.ATTN_NORM, "input_layernorm", None),
        (T.ATTN_Q, "self_attn.q_proj", None),
        (T.ATTN_K, "self_attn.k_proj", None),
        (T.ATTN_V, "self_attn.v_proj", None),
        (T.ATTN_OUT, "self_attn.o_proj", None),
        (T.FFN_NORM, "post_attention_layernorm", None),
        (T.FFN_GATE, "mlp.gate_proj", 0),
        (T.FFN_UP, "mlp.up_proj", 0),
        (T.FFN_DOWN, "mlp.down_proj", 1),
    ),
    after=(TensorRow(T.OUTPUT_NORM, "model.norm"), TensorRow(T.OUTPUT, "lm_head")),
)

# Mixtral: LLaMA's attention; per layer a router and experts, which GGUF stores stacked
# ([experts, d_ff, d_model] for gate and up, [experts, d_model, d_ff] for down) as llama.cpp's
# converter does, under the "llama" architecture with expert-count keys.
_MIXTRAL_MOE = "block_sparse_moe."
MIXTRAL = ArchitectureTable(
    gguf_architecture="llama",
    before=LLAMA.before,
    block=tuple(row for row in LLAMA.block if row.neuron_axis is None) + _block(  # all but the FFN
        "model.layers.{bid}." + _MIXTRAL_MOE,
        (T.FFN_GATE_INP, "gate", None),
        (T.FFN_GATE_EXP, "experts.{xid}.w1", 0),
        (T.FFN_UP_EXP, "experts.{xid}.w3", 0),
        (T.FFN_DOWN_EXP, "experts.{xid}.w2", 1),
    ),
    after=LLAMA.after,
)

# Qwen2: LLaMA's tensors and names, biases on q, k and v (none on the output projection), and
# llama.cpp's "neox" rope: its converter stores q and k in the checkpoint's row order.
QWEN2 = dataclasses.replace(LLAMA, gguf_architecture="qwen2", rope_pairs=RopePairs.HALVES,
                            attention_biases=(T.ATTN_Q, T.ATTN_K, T.ATTN_V))

# Gemma 3 (text): RMSNorm of q and k per head before RoPE (attn_q_norm, attn_k_norm), and norms after
# attention and after the FFN as well as before (post_attention_norm, post_ffw_norm); no biases, "neox"
# rope, GeGLU FFN. llama.cpp's Gemma 3 converter writes every norm as 1 + w.
_GEMMA3_LAYER = "model.layers.{bid}."
GEMMA3 = ArchitectureTable(
    gguf_architecture="gemma3",
    before=LLAMA.before,
    block=_block(
        _GEMMA3_LAYER,
        (T.ATTN_NORM, "input_layernorm", None),
        (T.ATTN_Q, "self_attn.q_proj", None),
        (T.ATTN_K, "self_attn.k_proj", None),
        (T.ATTN_V, "self_attn.v_proj", None),
        (T.ATTN_Q_NORM, "self_attn.q_norm", None),
        (T.ATTN_K_NORM, "self_attn.k_norm", None),
        (T.ATTN_OUT, "self_attn.o_proj", None),
        (T.ATTN_POST_NORM, "post_attention_layernorm", None),
        (T.FFN_NORM, "pre_feedforward_layernorm", None),
        (T.FFN_GATE, "mlp.gate_proj", 0),
        (T.FFN_UP, "mlp.up_proj", 0),
        (T.FFN_DOWN, "mlp.down_proj", 1),
        (T.FFN_POST_NORM, "post_feedforward_layernorm", None),
    ),
    after=LLAMA.after,
    rope_pairs=RopePairs.HALVES,
    attention_biases=(),
    norm_offset=1.0,
    scaled_embeddings=True,
)

_OPT_DECODER = "model.decoder."
OPT = ArchitectureTable(
    gguf_architecture="opt",
    before=(
        TensorRow(T.TOKEN_EMBD, _OPT_DECODER + "embed_tokens"),
        TensorRow(T.POS_EMBD, _OPT_DECODER + "embed_positions"),  # with OPT's two leading offset rows
        TensorRow(None, _OPT_DECODER + "project_in"),
    ),
    block=_block(
        _OPT_DECODER + "layers.{bid}.",
        (T.ATTN_NORM, "self_attn_layer_norm", None),
        (T.ATTN_Q, "self_attn.q_proj", None),
        (T.ATTN_K, "self_attn.k_proj", None),
        (T.ATTN_V, "self_attn.v_proj", None),
        (T.ATTN_OUT, "self_attn.out_proj", None),
        (T.FFN_NORM, "final_layer_norm", None),
        (T.FFN_UP, "fc1", 0),
        (T.FFN_DOWN, "fc2", 1),
    ),
    # PowerInfer's OPT computes the logits with token_embd: there is no output tensor.
    after=(
        TensorRow(None, _OPT_DECODER + "project_out"),
        TensorRow(T.OUTPUT_NORM, _OPT_DECODER + "final_layer_norm"),
        TensorRow(None, "lm_head"),  # untied OPT checkpoints only, which have no GGUF layout
    ),
)

# ModelSpec.architecture -> its table. Mistral is LLaMA to llama.cpp: the same tensors, the same name.
TABLES: dict[str, ArchitectureTable] = {"llama": LLAMA, "mistral": LLAMA, "mixtral": MIXTRAL, "qwen2": QWEN2,
                                         "gemma3": GEMMA3, "opt": OPT}

# The neuron axis of a block's GGUF tensor as stored. GGUF keeps the checkpoint's [out, in] NumPy
# shape, so the tables' axes hold (ffn_down [d, d_ff]: 1), one further for experts stacked in front;
# PowerInfer's transposed ffn_down_t [d_ff, d] and the predictor's fc2 [d_ff, hidden] have one row per neuron.
_GGUF_NEURON_AXIS: dict[TensorKind, int] = {
    **{row.tensor: row.neuron_axis + row.per_expert for table in TABLES.values() for row in table.neuron_rows()},
    PowerInferTensor.FFN_DOWN_T: 0,
    PowerInferTensor.PREDICTOR_FC2: 0,
}
# Only gate and up biases are per neuron; ffn_down's bias (either layout) is per output.
_NEURON_BIASES = (T.FFN_GATE, T.FFN_UP)


def stored_neuron_axis(tensor: TensorKind) -> int | None:
    """The neuron axis of a block tensor's weight as a GGUF file stores it, None if it has none."""
    return _GGUF_NEURON_AXIS.get(tensor)


def gguf_neuron_axis(name: str) -> int | None:
    """The neuron axis of a block's GGUF tensor (``blk.N.ffn_up.weight``, an expert's
    ``blk.N.ffn_up.X.weight`` ...), None if it has none."""
    parts = name.split(".")
    if len(parts) not in (4, 5) or not parts[1].isdigit() or (len(parts) == 5 and not parts[3].isdigit()):
        return None
    layer, expert = int(parts[1]), int(parts[3]) if len(parts) == 5 else None
    for tensor, axis in _GGUF_NEURON_AXIS.items():
        if name == tensor_name(tensor, layer, expert=expert):
            return axis
        if name == tensor_name(tensor, layer, "bias", expert):
            return 0 if tensor in _NEURON_BIASES else None
    return None
