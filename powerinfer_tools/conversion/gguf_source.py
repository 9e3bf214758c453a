"""A GGUF model file read as a Hugging Face checkpoint, so that ``pitools convert`` takes one as its source.

People have GGUF files (llama.cpp's converter, Ollama, LM Studio) far more often than checkpoints.
``GGUFSource`` answers what conversion and the reference engine ask of a ``checkpoints.Checkpoint``:

* ``spec``: the ``ModelSpec`` its metadata stands for (``models.spec_from_model_file``), where a checkpoint's
  comes from its config.json (``models.checkpoint_spec``), so profiling, predictor training, threshold
  calibration and writing run unchanged;
* the tensors by their Hugging Face names (the family's rows, ``formats.gguf_names.tensor_names``,
  read backwards), dequantized to float32 from any type gguf-py decodes, and with the q/k rows that
  llama.cpp's converter regrouped for its "normal" rope (``rope_row_order``) put back in the
  checkpoint's order;
* the tokenizer: the runtime's ``GGUFTokenizer`` on the file's metadata, which tokenizes calibration
  text as llama.cpp does, and the tokenizer keys themselves (with the chat template and the file's
  descriptive ``general.*`` keys), copied with their types into the output.

The file stays memory-mapped and one tensor at a time is dequantized: the one being written (the
writer asks for it a chunk of rows at a time) or loaded, so a conversion never holds the float32
weights of the whole model (profiling's reference engine does: it computes with all of them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, MODEL_TENSOR, GGMLQuantizationType, GGUFWriter, Keys
from gguf.quants import dequantize

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.constants import tensor_name
from powerinfer_tools.formats.gguf_names import rope_row_order, tensor_names
from powerinfer_tools.formats.model_check import check_model_tensors, sparse_layout
from powerinfer_tools.formats.model_file import (
    ModelFile,
    StoredTensor,
    copy_metadata,
    open_model_file,
)
from powerinfer_tools.formats.model_spec import ModelSpec
from powerinfer_tools.formats.safetensors_file import NonFiniteTensor, TensorInfo
from powerinfer_tools.models import spec_from_model_file
from powerinfer_tools.runtime.tokenizer import GGUFTokenizer

# Keys the output takes from the source as they are: the tokenizer's (vocabulary, merges, special tokens,
# chat template) and the descriptive general.* ones. The hyperparameters are written anew from the spec.
CARRIED_PREFIXES = ("tokenizer.", "general.")
# general.* keys the converter writes itself, or that describe this file's layout, not the model.
_REWRITTEN = (Keys.General.ARCHITECTURE, Keys.General.NAME, Keys.General.FILE_TYPE,
              Keys.General.QUANTIZATION_VERSION, Keys.General.ALIGNMENT)


@dataclass(frozen=True)
class _Part:
    """Where a Hugging Face tensor lies in the file."""

    tensor: StoredTensor
    shape: tuple[int, ...]  # the checkpoint's
    expert: int | None = None  # its expert's slice of a mixture's stacked tensor
    rows: np.ndarray | None = None  # checkpoint row i is stored row rows[i] (q/k regrouped for llama.cpp's rope)
    offset: float = 0.0  # what the file added to the checkpoint's values (Gemma's norms: 1)


@dataclass(frozen=True)
class CarriedMetadata:
    """The source's tokenizer and descriptive keys, which ``add_to`` copies into a writer with their types
    (what ``formats.tokenizer_gguf.GGUFVocab`` is for a checkpoint)."""

    model: ModelFile

    def add_to(self, writer: GGUFWriter) -> None:
        dropped = {key for key in self.model.metadata if not key.startswith(CARRIED_PREFIXES) or key in _REWRITTEN}
        copy_metadata(self.model, writer, skip=dropped)


class GGUFSource:
    """A GGUF file as conversion's source; refused, naming the file, unless every tensor and key it holds has
    a place in a checkpoint of a supported architecture."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.model = open_model_file(self.path)
        self.spec = _source_spec(self.model)
        # Its heldout.txt, when it has one, is the default calibration text (as `pitools perplexity` reads it).
        self.folder = self.path.resolve().parent
        self._parts = _checkpoint_parts(self.model, self.spec)
        self._last: tuple[str, np.ndarray] | None = None

    @property
    def name(self) -> str:
        """general.name, else the file's name."""
        return self.model.get(Keys.General.NAME) or self.path.stem

    def __contains__(self, name: str) -> bool:
        return name in self._parts

    def _part(self, name: str) -> _Part:
        try:
            return self._parts[name]
        except KeyError:
            raise PitoolsError(f"{self.path}: the model has no tensor {name!r}") from None

    def info(self, name: str) -> TensorInfo:
        """The tensor as ``raw`` returns it (float32, the checkpoint's shape); its bytes where the file stores them."""
        part = self._part(name)
        return TensorInfo(name, self.path, "F32", part.shape, part.tensor.offset, part.tensor.nbytes)

    def check_weight(self, name: str, shape: tuple[int, ...]) -> None:
        if self._part(name).shape != tuple(shape):
            raise PitoolsError(f"{self.path}: tensor {name!r} has shape {list(self._part(name).shape)}, "
                               f"the metadata implies {list(shape)}")

    def raw(self, name: str) -> np.ndarray:
        """The tensor in float32, read-only, rows in the checkpoint's order. The last one asked for is kept:
        the writer asks for a tensor's rows chunk by chunk, one tensor after the other."""
        if self._last is None or self._last[0] != name:
            self._last = None  # the previous tensor is freed before the next is made
            self._last = name, _dequantized(self._part(name))
        return self._last[1]

    def tensor(self, name: str, dtype=np.float32) -> np.ndarray:
        return self.raw(name).astype(dtype, copy=False)

    def check_finite(self, name: str, values: np.ndarray) -> None:
        """Refuse ``values`` (all or part of tensor ``name``) if any is NaN or infinite (a damaged scale)."""
        if not np.isfinite(values).all():
            count = int(np.count_nonzero(~np.isfinite(self.raw(name))))
            raise NonFiniteTensor(f"{self.path}: tensor {self._part(name).tensor.name} has {count} non-finite "
                                  "values (NaN/inf)")

    def tokenizer(self, spec: ModelSpec) -> GGUFTokenizer:
        """The file's tokenizer; spellings of special tokens in calibration text are those tokens, as a
        checkpoint's Hugging Face tokenizer reads them (``spec``: the file's own, its special tokens)."""
        return GGUFTokenizer(self.model.metadata, parse_special=True, source=str(self.path))

    def vocab(self, n_vocab: int) -> CarriedMetadata:
        """The tokenizer metadata, as the file has it (``check_model_tensors`` found ``n_vocab`` tokens there)."""
        return CarriedMetadata(self.model)


def _source_spec(model: ModelFile) -> ModelSpec:
    """The spec of a file conversion can read as a checkpoint, whose tensors are all there."""
    if Keys.Tokenizer.MODEL not in model.metadata or Keys.Tokenizer.LIST not in model.metadata:
        raise PitoolsError(f"{model.path}: the file has no embedded tokenizer ({Keys.Tokenizer.MODEL}, "
                           f"{Keys.Tokenizer.LIST}); a model file needs one")
    if model.powerinfer or sparse_layout(model):
        raise PitoolsError(f"{model.path}: a file in PowerInfer's sparse layout; convert the dense model it was made from")
    spec = spec_from_model_file(model)
    check_model_tensors(model, spec)  # every tensor is one the family has: none is lost
    return spec


def _checkpoint_parts(model: ModelFile, spec: ModelSpec) -> dict[str, _Part]:
    """Each Hugging Face tensor's place in the file (a tensor the checkpoint does not hold, as Llama 3.1's
    rope_freqs, is in the spec)."""
    parts = {}
    for t in tensor_names(spec, powerinfer=False):
        if (t.target == tensor_name(MODEL_TENSOR.OUTPUT) and spec.tied_embeddings) or t.values is not None:
            continue  # a tied model's head is its token embedding, named already
        stored = model[t.target]
        _check_decodable(model.path, stored)
        rows = np.argsort(rope_row_order(t.shape[0], t.rope_heads)) if t.rope_heads else None
        for expert, name in enumerate(t.sources):
            parts[name] = _Part(stored, t.shape, expert if t.stacked else None, rows, t.offset)
    return parts


def _check_decodable(path: Path, stored: StoredTensor) -> None:
    if not _decodable(stored.qtype):
        raise PitoolsError(f"{path}: tensor {stored.name} is stored as {stored.qtype.name}, which gguf-py "
                           "cannot dequantize")


@functools.cache
def _decodable(qtype: GGMLQuantizationType) -> bool:
    """Whether gguf-py dequantizes ``qtype``: every type llama.cpp quantizes to (Q2_K, Q3_K, IQ*, ...), more
    than the runtime computes (``formats.weight_types.WEIGHT_TYPES``). Asked of one block of zeros."""
    try:
        dequantize(np.zeros(GGML_QUANT_SIZES[qtype][1], dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _dequantized(part: _Part) -> np.ndarray:
    data = part.tensor.data if part.expert is None else part.tensor.data[part.expert]
    values = np.asarray(dequantize(data, part.tensor.qtype), dtype=np.float32).reshape(part.shape)
    if part.rows is not None:
        values = values[part.rows]
    if part.offset:
        values = values - np.float32(part.offset)
    values.flags.writeable = False  # shared by everyone who asks until the next tensor
    return values
