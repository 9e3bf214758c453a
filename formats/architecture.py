"""A model family's descriptor: everything the code asks about an architecture, in one row.

Each family's row is its model module's ``ARCHITECTURE`` (``models/<family>.py``, listed by
``models/__init__.py``), and every ``ModelSpec`` carries the row of its family
(``spec.architecture``): the converter, the runtime, the solver and synth ask the row, never test an
architecture's name (tests/test_architecture.py holds that). A row says how the family's config.json
reads (``spec_from_config``), what llama.cpp calls it, its tensors, its norms and rotary embeddings, the
FFN a GGUF file of it computes, and which GGUF keys and tensors it understands: a file holding any other
that would change the computation is refused (``formats/gguf_spec.py``), never run wrongly.

The tensor rows are in the spirit of gguf-py's ``tensor_mapping.py``: each pairs a GGUF tensor
(``gguf.MODEL_TENSOR``, spelled by ``gguf.TENSOR_NAMES``) with the checkpoint's name for it (``{bid}``:
the block). A mixture of experts has a row for the router (``MODEL_TENSOR.FFN_GATE_INP``) and rows whose
Hugging Face name also has an ``{xid}`` (the expert) for ``MODEL_TENSOR.FFN_GATE_EXP`` and friends, which
GGUF stores stacked as ``blk.N.ffn_gate_exps``. A fused tensor (Phi-3's ``qkv_proj``) is one row whose
``parts`` are the tensors whose rows it holds one after the other.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from gguf import MODEL_TENSOR
from powerinfer_tools.formats.constants import PowerInferTensor, TensorKind, tensor_name
from powerinfer_tools.formats.model_spec import FFNKind, ModelSpec, NormKind
from powerinfer_tools.formats.rope import RopeKind

T = MODEL_TENSOR


@dataclass(frozen=True)
class TensorRow:
    """A tensor of the architecture: its GGUF kind and its Hugging Face name."""

    tensor: MODEL_TENSOR | None  # None: a Hugging Face tensor that has no GGUF layout (OPT-350m's projections)
    hf: str  # the checkpoint's name without ".weight"/".bias"; "{bid}": the block, "{xid}": the expert
    # A fused tensor: the tensors whose rows it holds, in order (Phi-3's qkv_proj: q, k, v; gate_up_proj: gate, up).
    parts: tuple[MODEL_TENSOR, ...] = ()

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
    HALVES = "halves"  # LLAMA_ROPE_TYPE_NEOX: Qwen2, Qwen3, Phi-3, Gemma 3


def _nothing(spec: ModelSpec) -> None:
    return None


@dataclass(frozen=True, eq=False, repr=False)
class Architecture:
    """One model family (see the module's doc). Two rows are the same family when their names are."""

    name: str  # ours: "llama", "qwen3" (profile folders record it)
    gguf_name: str  # general.architecture as llama.cpp's converter writes it
    model_types: tuple[str, ...]  # the config.json model_type values read as this family
    hf_classes: tuple[str, ...]  # transformers' classes for it (config.json "architectures"), first the usual one
    # Tensors in GGUF file order: before the blocks, per block, after them.
    before: tuple[TensorRow, ...]
    block: tuple[TensorRow, ...]
    after: tuple[TensorRow, ...]
    # config.json (parsed) -> its spec, refusing what the family's model cannot compute; ``config_keys`` names the
    # ModelSpec fields' keys in messages.
    spec_from_config: Callable[[dict], ModelSpec]
    config_keys: Mapping[str, str]
    model: Any  # the reference engine's class (models/), ``from_checkpoint(spec, checkpoint, dtype, layers)``
    # general.architecture values a GGUF file of the family may have (None: its own name only; (): none, a family
    # whose files read back as another's), and whether its layers are mixtures of experts (as a file's expert
    # count tells). PowerInfer's name of the family's dReLU models in its sparse layout ("bamboo": LLaMA's).
    gguf_names: tuple[str, ...] | None = None
    moe: bool = False
    powerinfer_drelu_name: str | None = None
    # The FFNs the family's configs may have (hidden_act: silu; relu is ReluLLaMA's and ProSparse's ReGLU, drelu
    # TurboSparse's and Bamboo's); the FFN of a file without pitools.ffn_activation, as llama.cpp and PowerInfer
    # decide it: a dense file's, and a file of PowerInfer's sparse layout's (PowerInfer's LLaMA is ReGLU).
    ffn_kinds: tuple[FFNKind, ...] = (FFNKind.SWIGLU, FFNKind.REGLU, FFNKind.DRELU)
    dense_ffn: FFNKind = FFNKind.SWIGLU
    sparse_ffn: FFNKind = FFNKind.REGLU
    norm: NormKind = NormKind.RMS
    # The rotary pairs llama.cpp's architecture rotates (the rows of q and k follow); unused without RoPE.
    rope_pairs: RopePairs = RopePairs.ADJACENT
    # The rope scalings the family's config and GGUF files may have (formats/rope.py).
    rope_kinds: tuple[RopeKind, ...] = (RopeKind.NONE, RopeKind.LINEAR)
    # The attention projections that carry a bias in a model with ModelSpec.attention_bias.
    attention_biases: tuple[MODEL_TENSOR, ...] = (T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.ATTN_OUT)
    # What GGUF adds to the checkpoint's RMSNorm weights: Gemma's norms scale by (1 + w), and llama.cpp's
    # converter stores 1 + w so that its plain RMSNorm computes them.
    norm_offset: float = 0.0
    # Token embeddings multiplied by sqrt(d_model) before the first layer (Gemma).
    scaled_embeddings: bool = False
    # ModelSpec fields a GGUF file of the family stores otherwise than the others, given a metadata getter
    # (``{arch}`` keys spelled out): what llama.cpp's architecture assumes (Gemma 3's local rope base) or reads
    # in its own way. Further keys it reads are named in ``gguf_keys`` (``{arch}.``-relative).
    gguf_fields: Callable[[Callable[[str], Any]], dict] = lambda get: {}
    gguf_keys: tuple[str, ...] = ()
    # Refuses a spec that llama.cpp's architecture cannot hold (a GGUF file of it would compute another model).
    check_layout: Callable[[ModelSpec], None] = _nothing

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Architecture) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"Architecture({self.name!r})"

    @property
    def rows(self) -> tuple[TensorRow, ...]:
        return self.before + self.block + self.after

    @property
    def rotary(self) -> bool:
        """Positions by rotary embeddings; else by a learned table (OPT)."""
        return not self.has(T.POS_EMBD)

    def reads_gguf(self, gguf_name: str, moe: bool) -> bool:
        """Whether a GGUF file of architecture ``gguf_name``, with experts or not, is of this family."""
        names = (self.gguf_name,) if self.gguf_names is None else self.gguf_names
        return gguf_name in names and moe == self.moe

    def has(self, tensor: MODEL_TENSOR) -> bool:
        """Whether the architecture has ``tensor``: a row of its own, or part of a fused row."""
        return any(row.tensor is tensor or tensor in row.parts for row in self.rows)

    def row(self, tensor: MODEL_TENSOR | None, hf: str | None = None) -> TensorRow:
        """The row of ``tensor`` (for a tensor with no GGUF layout, the one whose name ends in ``hf``); for a part
        of a fused tensor, the fused row."""
        for row in self.rows:
            if (row.tensor is tensor or (tensor is not None and tensor in row.parts)) and (
                    hf is None or row.hf.endswith(hf)):
                return row
        raise KeyError(f"the architecture has no tensor {tensor.name if tensor else hf}")

    def hf_name(self, tensor: MODEL_TENSOR, layer: int | None = None, part: str = "weight",
                expert: int | None = None) -> str:
        """The checkpoint's name for ``tensor``: ``hf_name(FFN_UP, 3)`` is ``model.layers.3.mlp.up_proj.weight``
        (for a part of a fused tensor, the fused tensor's name: ``fused_rows`` says where it lies)."""
        return self.row(tensor).hf_name(layer, part, expert)


def fused_rows(row: TensorRow, tensor: MODEL_TENSOR, rows_of: Callable[[MODEL_TENSOR], int]) -> slice:
    """Where ``tensor``'s rows lie in the fused ``row`` (all of it for a row that is ``tensor``'s own), given
    each part's row count ``rows_of(part)``."""
    if not row.parts:
        return slice(None)
    start = 0
    for part in row.parts:
        if part is tensor:
            return slice(start, start + rows_of(part))
        start += rows_of(part)
    raise KeyError(f"{row.hf} holds no {tensor.name}")


def block_rows(prefix: str, *rows: tuple) -> tuple[TensorRow, ...]:
    """A block's rows: (GGUF tensor, Hugging Face name below ``prefix``[, fused parts])."""
    return tuple(TensorRow(tensor, prefix + hf, *parts) for tensor, hf, *parts in rows)


# The neuron axis of a block's FFN tensor as a GGUF file stores it: GGUF keeps the checkpoint's [out, in]
# NumPy shape (ffn_down [d, d_ff]: 1), one further for experts stacked in front; PowerInfer's transposed
# ffn_down_t [d_ff, d] and the predictor's fc2 [d_ff, hidden] have one row per neuron.
_GGUF_NEURON_AXIS: dict[TensorKind, int] = {
    T.FFN_GATE: 0, T.FFN_UP: 0, T.FFN_DOWN: 1, T.FFN_GATE_EXP: 1, T.FFN_UP_EXP: 1, T.FFN_DOWN_EXP: 2,
    PowerInferTensor.FFN_DOWN_T: 0, PowerInferTensor.PREDICTOR_FC2: 0,
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
