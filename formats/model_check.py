"""Does a model file hold the tensors its metadata promises?

The metadata (``{arch}.embedding_length``, ``feed_forward_length``, ...) and the
tensor table are written separately, and either can be damaged or edited. Every
reader that computes with the tensors (the runtime, the solver's sizes) checks
here first, so a mismatch is one error naming the file and the tensor instead
of a shape error deep inside a kernel. Whether tensors hold NaN or infinity is
``check_finite``'s question, asked of what a reader has at hand (the runtime: the
norms and biases it copies at load, every tensor once its logits are not finite).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np
from gguf import MODEL_TENSOR, Keys
from powerinfer_tools.formats.constants import (
    PowerInferTensor,
    expert_frequency_key,
    neuron_frequency_key,
    predictor_names,
    tensor_name,
)
from powerinfer_tools.formats.ffn_bundle import BundleLayout
from powerinfer_tools.formats.gguf_names import tensor_names
from powerinfer_tools.formats.metadata_keys import read_key
from powerinfer_tools.formats.model_file import ModelFile, StoredTensor
from powerinfer_tools.formats.model_spec import ModelSpec
from powerinfer_tools.formats.quantization import decode
from powerinfer_tools.formats.safetensors_file import NonFiniteTensor

from powerinfer_tools.errors import PitoolsError


def sparse_layout(model: ModelFile) -> bool:
    """Whether the file stores the down projection neuron-major (PowerInfer's ``ffn_down_t``, or bundled;
    a mixture's first expert's ``ffn_down_t.0``)."""
    return any(tensor_name(t, 0, expert=expert) in model
               for t in (PowerInferTensor.FFN_DOWN_T, PowerInferTensor.FFN_BUNDLE) for expert in (None, 0))


def check_model_tensors(model: ModelFile, spec: ModelSpec) -> None:
    """Every tensor ``spec`` implies is present with its shape, and no other (``_refuse_unknown_tensors``); the
    predictors fit (``check_predictors``), and the vocabulary, when the file has one, has a token per embedding row
    and, byte-level BPE, its merges."""
    bundle = BundleLayout.of_file(model)
    bundled = set() if bundle is None else {tensor_name(p.tensor, i) for p in bundle.parts for i in range(spec.n_layers)}
    expected_names = tensor_names(spec, sparse_layout(model))
    for expected in expected_names:
        if expected.target == tensor_name(MODEL_TENSOR.OUTPUT) and spec.tied_embeddings:
            continue  # a tied model's head is its token embedding
        if expected.target not in bundled:
            _check_shape(model, expected.target, expected.stored_shape)
    bundles = [] if bundle is None else [tensor_name(PowerInferTensor.FFN_BUNDLE, i) for i in range(spec.n_layers)]
    for name in bundles:
        _check_shape(model, name, (spec.d_ff, bundle.stride))
    check_predictors(model, spec)
    predictors = [name for unit in spec.ffn_units for name in predictor_names(unit.layer, unit.expert)]
    _refuse_unknown_tensors(model, spec, {t.target for t in expected_names} | set(bundles) | set(predictors))
    read_key(model.get, Keys.Tokenizer.LIST, model.path, spec.vocab_size)  # a token per row of the embedding
    bpe_merges(model.get, model.path)


def bpe_merges(get: Callable[[str], Any], source: Any) -> list[str] | None:
    """A byte-level BPE (``gpt2``) vocabulary's merges by ``get`` (a model file's, its metadata's), ``"left right"``
    in rank order; None for another vocabulary. A BPE vocabulary without them is refused, as llama.cpp refuses it
    ("cannot find tokenizer merges", llama-vocab.cpp; it excepts Kimi-K2's, an architecture we do not read):
    merged by no merges, text would be tokenized a character at a time."""
    if get(Keys.Tokenizer.MODEL) != "gpt2":
        return None
    return read_key(get, Keys.Tokenizer.MERGES, source,
                    required="a gpt2 vocabulary is merged by them; llama.cpp refuses a file without")


# Values dequantized at a time when a tensor is searched for NaN or infinity: a float32 copy of a large tensor
# whole (a 150,000-token embedding: over a gigabyte) would take more memory than the run that asks.
_CHUNK_VALUES = 1 << 22


def check_finite(model: ModelFile, names: Iterable[str]) -> None:
    """Refuse (``NonFiniteTensor``, as conversion does) the first of the tensors ``names`` holding a NaN or an
    infinite value. It reads every byte of them: the runtime asks it of every tensor only once its logits
    showed damage, never on a load."""
    for name in names:
        if count := _nonfinite_count(model[name]):
            raise NonFiniteTensor(f"{model.path}: tensor {name} has {count} non-finite values (NaN/inf)")


def _nonfinite_count(tensor: StoredTensor) -> int:
    """How many of ``tensor``'s values are NaN or infinite, dequantized a chunk of rows at a time."""
    rows = tensor.data.reshape(-1, tensor.data.shape[-1])
    step = max(1, _CHUNK_VALUES // tensor.shape[-1])
    return sum(int(np.count_nonzero(~np.isfinite(decode(rows[start : start + step], tensor.qtype))))
               for start in range(0, len(rows), step))


def _refuse_unknown_tensors(model: ModelFile, spec: ModelSpec, known: set[str]) -> None:
    """A tensor that is not part of the model as the runtime computes it (llama.cpp's rope_factors_long of a
    longrope Phi-3, say) would be ignored, and another model computed: the file is refused, naming it."""
    unknown = sorted(set(model.tensors) - known)
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if unknown[1:] else ""
        raise PitoolsError(f"{model.path}: tensor {unknown[0]}{more} is not part of a {spec.architecture} model as "
                           "the runtime computes it; the file cannot be run")


def check_predictors(model: ModelFile, spec: ModelSpec) -> None:
    """Predictors come in fc1/fc2 pairs that fit the model, in a file of the sparse layout (``inspect`` checks
    this alone: it shows files whose other tensors are missing)."""
    for unit in spec.ffn_units:
        fc1, fc2 = predictor_names(unit.layer, unit.expert)
        if fc1 not in model and fc2 not in model:
            continue
        if not sparse_layout(model):
            raise PitoolsError(f"{model.path}: predictor {fc1} in a file without ffn_down_t: "
                               "sparse execution needs PowerInfer's layout")
        hidden = model[fc1].shape[0] if fc1 in model else model[fc2].shape[-1]
        _check_shape(model, fc1, (hidden, spec.d_model))
        _check_shape(model, fc2, (spec.d_ff, hidden))


def _check_shape(model: ModelFile, name: str, shape: tuple[int, ...]) -> None:
    if name not in model:
        raise PitoolsError(f"{model.path}: tensor {name} is missing")
    if tuple(model[name].shape) != tuple(shape):
        raise PitoolsError(f"{model.path}: tensor {name} has shape {list(model[name].shape)}; "
                           f"the metadata implies {list(shape)}")


def routing_frequencies(model: ModelFile, spec: ModelSpec, layer: int) -> np.ndarray | None:
    """A mixture layer's recorded routing frequency per expert, the share of profiled tokens routed to it
    (None when the file has none), checked to be ``n_experts`` finite shares in [0, 1]."""
    return _probabilities(model, expert_frequency_key(layer), spec.n_experts)


def neuron_frequencies(model: ModelFile, spec: ModelSpec, layer: int, expert: int | None = None) -> np.ndarray | None:
    """A layer's (or an expert's) recorded firing probabilities (None when the file has none), checked to
    be ``d_ff`` finite probabilities."""
    return _probabilities(model, neuron_frequency_key(layer, expert), spec.d_ff)


def _probabilities(model: ModelFile, key: str, count: int) -> np.ndarray | None:
    """The metadata array ``key`` as float64, checked to be ``count`` values in [0, 1]; None when absent."""
    values = read_key(model.get, key, model.path, count)
    return None if values is None else np.asarray(values, dtype=np.float64)
