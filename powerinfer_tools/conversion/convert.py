"""Converting a Hugging Face checkpoint (or a GGUF file) into a dense GGUF or a PowerInfer model file.

The pipeline, one function per step:

1. ``source_path`` and ``open_source`` (source.py): a folder, a hub id downloaded into one, or a GGUF
   file read as a checkpoint (gguf_source.py);
2. ``plan_conversion``: read config.json and tokenizer.json, choose the layout
   (dense or PowerInfer), the architecture name, and for every output tensor its
   GGUF name, orientation and type -- without reading any weights;
3. ``write_model``: stream the planned tensors into the file, one at a time.

The sparsity steps (profile activations, train predictors, reorder neurons by
hotness) belong between 2 and 3: they produce the ``PredictorFolder`` passed to
``plan_conversion``, and a neuron order is a ``row_order`` on the FFN tensors'
``CheckpointRows`` (gate/up rows, ``ffn_down_t`` rows, predictor fc2 rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_VERSION, GGUFWriter

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.checkpoints.hub import looks_local
from powerinfer_tools.conversion.gguf_source import CarriedMetadata, GGUFSource
from powerinfer_tools.conversion.source import open_source, source_path
from powerinfer_tools.conversion.sparsify import (
    SparsifySettings,
    SparsityArtifacts,
    calibrate_checkpoint,
    prepare_sparsity,
    thresholded_artifacts,
    work_folder,
)
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.fileio import atomic_output, check_writable_output
from powerinfer_tools.formats.constants import (
    PREDICTOR_COMPUTED_KEY,
    PREDICTOR_PRECISION_KEY,
    PREDICTOR_RECALL_KEY,
    SPARSE_THRESHOLD_KEY,
    expert_frequency_key,
    neuron_frequency_key,
    predictor_names,
)
from powerinfer_tools.formats.activation_thresholds import ActivationThresholds
from powerinfer_tools.formats.gguf_names import (add_hyperparameters, gguf_architecture, logits_tensor, rope_row_order,
                                                 tensor_names)
from powerinfer_tools.formats.model_file import ModelFileWriter, OutputTensor
from powerinfer_tools.formats.predictor_folder import PredictorFolder, read_predictors
from powerinfer_tools.formats.quantization import OUTTYPES, OutType, tensor_type
from powerinfer_tools.formats.safetensors_file import NonFiniteTensor, bf16_to_float32
from powerinfer_tools.formats.architecture import gguf_neuron_axis
from powerinfer_tools.formats.tokenizer_gguf import GGUFVocab
from powerinfer_tools.formats.model_spec import FFNUnit
from powerinfer_tools.interfaces import Workers
from powerinfer_tools.models import ModelSpec, checkpoint_spec
from powerinfer_tools.profiling.calibration import Calibration

POWERINFER_SUFFIX, DENSE_SUFFIX = ".powerinfer.gguf", ".gguf"


@dataclass(frozen=True)
class CheckpointRows:
    """Rows of one checkpoint tensor as they are stored: optionally transposed, then reordered.

    The memory map is opened per call and dropped afterwards, so only the rows being
    converted are ever resident. Unless ``allow_nonfinite``, rows holding NaN or inf are
    refused as they stream past (``NonFiniteTensor``): no second pass over the weights.
    """

    checkpoint: Checkpoint | GGUFSource
    name: str
    transpose: bool = False
    row_order: np.ndarray | None = None
    allow_nonfinite: bool = False
    offset: float = 0.0  # added to every value as stored (gguf_names.TensorName.offset)
    source_rows: slice | None = None  # a part of a fused tensor: its rows there (gguf_names.TensorName.source_rows)

    def __call__(self, start: int, stop: int) -> np.ndarray:
        raw = self.checkpoint.raw(self.name)
        if self.source_rows is not None:
            raw = raw[self.source_rows]
        if self.transpose:
            raw = raw.T
        rows = raw[start:stop] if self.row_order is None else raw[self.row_order[start:stop]]
        if self.checkpoint.info(self.name).dtype == "BF16":
            rows = bf16_to_float32(rows)
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        if self.offset:
            rows = rows + np.float32(self.offset)
        if not self.allow_nonfinite:
            self.checkpoint.check_finite(self.name, rows)
        return rows


@dataclass(frozen=True)
class StackedRows:
    """A mixture's stacked tensor ``[experts, rows, cols]``: expert ``e`` is ``experts[e]``'s rows, one
    expert at a time (the writer's chunks of a 3-D tensor are whole experts)."""

    experts: tuple[CheckpointRows, ...]
    rows_per_expert: int

    def __call__(self, start: int, stop: int) -> np.ndarray:
        return np.stack([expert(0, self.rows_per_expert) for expert in self.experts[start:stop]])


@dataclass(frozen=True)
class ConversionPlan:
    """Everything that goes into the output file, weights still on disk."""

    name: str  # general.name
    spec: ModelSpec
    architecture: str  # general.architecture
    powerinfer: bool
    outtype: OutType
    vocab: GGUFVocab | CarriedMetadata  # from tokenizer.json, or a GGUF source's own keys
    tensors: list[OutputTensor]
    sparse_threshold: float | None = None
    neuron_frequencies: dict[FFNUnit, np.ndarray] | None = None  # per FFN, in the file's neuron order
    predictor_layers: list[dict] | None = None  # predictors.json's per-FFN quality, when predictors are merged
    routing: np.ndarray | None = None  # a mixture's routing frequencies [n_layers, experts]
    thresholds: ActivationThresholds | None = None  # a SiLU model's calibrated sparsity thresholds


def _choose_layout(spec: ModelSpec, dense: bool, predictors: PredictorFolder | None, thresholded: bool) -> bool:
    """True for the PowerInfer layout: the default for ReLU-family models, and SiLU models with thresholds."""
    if predictors is not None and (dense or not spec.ffn.sparse):
        why = "with --dense" if dense else f"to a {spec.ffn.value} model, which is not activation-sparse"
        raise PitoolsError(f"predictors do not apply {why}")
    if thresholded and (dense or spec.ffn.sparse):
        why = ("--dense writes the dense layout" if dense else
               f"its FFN is {spec.ffn.value}, sparse already: its predictors are trained, not thresholds")
        raise PitoolsError(f"--target-sparsity is for SiLU and GeGLU models: {why}")
    return (spec.ffn.sparse or thresholded) and not dense


@dataclass(frozen=True)
class MadeRows:
    """A tensor the checkpoint does not hold, made from its config.json (Llama 3.1's rope_freqs)."""

    values: tuple[float, ...]

    def __call__(self, start: int, stop: int) -> np.ndarray:
        return np.asarray(self.values[start:stop], dtype=np.float32)


class _Source(NamedTuple):
    target: str  # GGUF name
    shape: tuple[int, ...]  # as stored
    rows: CheckpointRows | StackedRows | MadeRows


def _model_tensors(checkpoint: Checkpoint | GGUFSource, spec: ModelSpec, powerinfer: bool, orders: dict | None,
                   allow_nonfinite: bool) -> list[_Source]:
    sources = []
    for t in tensor_names(spec, powerinfer):
        if t.values is not None:
            sources.append(_Source(t.target, t.stored_shape, MadeRows(t.values)))
            continue
        for source in t.sources:
            checkpoint.check_weight(source, t.checkpoint_shape)
        order = rope_row_order(t.shape[0], t.rope_heads) if t.rope_heads else None
        if orders is not None and gguf_neuron_axis(t.target) == 0:  # stored one row per neuron
            order = orders[t.unit]
        parts = tuple(CheckpointRows(checkpoint, source, t.transpose, order, allow_nonfinite, t.offset, t.source_rows)
                      for source in t.sources)
        rows = StackedRows(parts, t.stored_shape[1]) if t.stacked else parts[0]
        sources.append(_Source(t.target, t.stored_shape, rows))
    return sources


def _predictor_tensors(predictors: PredictorFolder, units: list[FFNUnit], orders: dict | None,
                       allow_nonfinite: bool) -> list[_Source]:
    """fc1 and fc2 of every FFN; fc2's rows follow the neuron order."""
    sources = []
    for unit in units:
        for name in predictor_names(unit.layer, unit.expert):
            order = orders[unit] if orders is not None and gguf_neuron_axis(name) == 0 else None
            rows = CheckpointRows(predictors.tensors, name, row_order=order, allow_nonfinite=allow_nonfinite)
            sources.append(_Source(name, predictors.tensors.info(name).shape, rows))
    return sources


def plan_conversion(
    checkpoint: Checkpoint | GGUFSource,
    name: str,
    outtype: str = "f16",
    dense: bool = False,
    predictors: PredictorFolder | None = None,
    sparsity: SparsityArtifacts | None = None,
    allow_nonfinite: bool = False,
) -> ConversionPlan:
    """Decide the layout, names and types of every output tensor; read headers only.

    With ``sparsity``, FFN neurons are stored hot-first (its ``orders``) and their
    firing frequencies go into the metadata for ``pitools solve``. Writing the plan
    refuses NaN/inf weights unless ``allow_nonfinite``.
    """
    if outtype not in OUTTYPES:
        raise PitoolsError(f"unknown output type {outtype!r} (supported: {', '.join(OUTTYPES)})")
    spec = checkpoint_spec(checkpoint)
    thresholds = sparsity.thresholds if sparsity is not None else None
    powerinfer = _choose_layout(spec, dense, predictors, thresholds is not None)
    vocab = checkpoint.vocab(spec.vocab_size)
    orders = sparsity.orders if sparsity is not None and powerinfer else None
    sources = _model_tensors(checkpoint, spec, powerinfer, orders, allow_nonfinite)
    if predictors is not None:
        sources += _predictor_tensors(predictors, spec.ffn_units, orders, allow_nonfinite)
    # The tensor that computes the logits: output.weight, or the shared embedding (OPT).
    logits = logits_tensor(s.target for s in sources)
    kind = OUTTYPES[outtype]
    tensors = [
        OutputTensor(s.target, s.shape, tensor_type(s.target, s.shape, kind, is_output=s.target == logits), s.rows)
        for s in sources
    ]
    threshold = predictors.sparse_threshold if predictors is not None else None
    frequencies, routing = None, None
    if sparsity is not None and sparsity.frequencies is not None and powerinfer:
        frequencies = {unit: f if orders is None else f[orders[unit]] for unit, f in sparsity.frequencies.items()}
        routing = sparsity.routing
    return ConversionPlan(
        name, spec, gguf_architecture(spec, powerinfer), powerinfer, kind, vocab, tensors, threshold, frequencies,
        predictors.meta["layers"] if predictors is not None else None, routing, thresholds,
    )


def _add_metadata(writer: GGUFWriter, plan: ConversionPlan) -> None:
    writer.add_name(plan.name)
    writer.add_file_type(plan.outtype.file_type)
    writer.add_quantization_version(GGML_QUANT_VERSION)
    add_hyperparameters(writer, plan.spec)
    if plan.sparse_threshold is not None:
        writer.add_float32(SPARSE_THRESHOLD_KEY, plan.sparse_threshold)
    for unit, freq in (plan.neuron_frequencies or {}).items():
        writer.add_array(neuron_frequency_key(unit.layer, unit.expert), [float(f) for f in freq])
    for layer, shares in enumerate(plan.routing if plan.routing is not None else []):
        writer.add_array(expert_frequency_key(layer), [float(f) for f in shares])
    if plan.thresholds is not None:
        plan.thresholds.add_to(writer)
    if plan.predictor_layers:
        for key, field in ((PREDICTOR_RECALL_KEY, "recall"), (PREDICTOR_PRECISION_KEY, "precision"),
                           (PREDICTOR_COMPUTED_KEY, "predicted_density")):
            writer.add_array(key, [float(layer[field]) for layer in plan.predictor_layers])
    plan.vocab.add_to(writer)


def write_model(plan: ConversionPlan, path: str | Path, progress: bool = True, overwrite: bool = True) -> None:
    """Write ``plan`` to ``path`` atomically: a temporary file beside it, moved there at the end (replacing
    a file there only with ``overwrite``)."""
    with atomic_output(path, overwrite=overwrite) as tmp:
        writer = ModelFileWriter(tmp, plan.architecture, plan.powerinfer)
        _add_metadata(writer.gguf, plan)
        writer.write(plan.tensors, progress)


def _model_name(source: str, checkpoint: Checkpoint | GGUFSource) -> str:
    """general.name: a GGUF source's own, else the checkpoint folder's name or the hub id's last part."""
    if isinstance(checkpoint, GGUFSource):
        return checkpoint.name
    return checkpoint.folder.resolve().name if looks_local(source) else source.rstrip("/").split("/")[-1]


def default_output(source: str, location: Path, powerinfer: bool, outtype: str) -> Path:
    """``<model>.powerinfer.gguf`` / ``<model>.gguf`` beside a local checkpoint folder, or in the
    current directory for a hub id (its folder is inside the Hugging Face cache); beside a GGUF file
    ``location``, ``<file>.powerinfer.gguf`` / ``<file>.<outtype>.gguf``, never the file itself."""
    suffix = POWERINFER_SUFFIX if powerinfer else DENSE_SUFFIX
    if location.is_file():
        return location.resolve().parent / f"{location.stem}{suffix if powerinfer else f'.{outtype}{suffix}'}"
    if looks_local(source):
        return location.resolve().parent / f"{location.resolve().name}{suffix}"
    return Path.cwd() / f"{source.rstrip('/').split('/')[-1]}{suffix}"


def _input_files(*locations) -> list[Path]:
    """Every file conversion reads: the GGUF source itself, or the files of the checkpoint folder, and those
    of the given profile/predictor folders."""
    paths = [Path(p) for p in locations if p is not None]
    return [p for path in paths for p in (path.iterdir() if path.is_dir() else [path]) if p.is_file()]


def convert(
    source: str,
    output: str | Path | None = None,
    outtype: str = "f16",
    dense: bool = False,
    predictors: str | Path | None = None,
    profile: str | Path | None = None,
    sparsify: SparsifySettings | None = None,
    force: bool = False,
    progress: bool = True,
    allow_nonfinite: bool = False,
    calibration: Calibration | None = None,
    workers: Workers | None = None,
) -> tuple[Path, ConversionPlan]:
    """Convert ``source`` (a checkpoint folder, a hub id or a GGUF file); return the output path and the
    plan written.

    With ``sparsify`` (the command line's default for ReLU-family models), a
    PowerInfer file gets predictors, hot-first neurons and firing frequencies:
    ``profile``/``predictors`` folders are reused when given, else made in the
    work folder beside the output. Without it, ``predictors`` are merged as given.
    A SiLU model with ``sparsify.target_sparsity`` or ``max_quality_loss`` (or a ready ``calibration``) gets the
    PowerInfer layout with calibrated thresholds instead of predictors.
    NaN/inf weights are refused unless ``allow_nonfinite`` (profiling refuses them always).
    ``workers`` profile and train the predictors (``--ray``; default: in this process).
    """
    location = source_path(source, progress)
    checkpoint = open_source(location)
    spec = checkpoint_spec(checkpoint)
    name = _model_name(source, checkpoint)
    thresholded = calibration is not None or (sparsify is not None and sparsify.thresholded)
    sparse_layout = _choose_layout(spec, dense, None, thresholded)
    path = Path(output) if output is not None else default_output(source, location, sparse_layout, outtype)
    check_writable_output(path, force, inputs=_input_files(location, profile, predictors))
    plan_conversion(checkpoint, name, outtype, dense)  # every input check before the long sparsity steps
    try:
        sparsity = None
        if thresholded:
            calibration = calibration or calibrate_checkpoint(location, sparsify, progress, OUTTYPES[outtype])
            sparsity = thresholded_artifacts(calibration, sparsify.reorder if sparsify is not None else True)
        elif sparsify is not None and sparse_layout:
            sparsity = prepare_sparsity(
                location,
                work_folder(path),
                sparsify,
                Path(profile) if profile is not None else None,
                Path(predictors) if predictors is not None else None,
                progress,
                workers,
            )
            predictors = sparsity.predictors
        predictor_folder = read_predictors(predictors, spec) if predictors is not None else None
        plan = plan_conversion(checkpoint, name, outtype, dense, predictor_folder, sparsity, allow_nonfinite)
        write_model(plan, path, progress, overwrite=force)
    except NonFiniteTensor as exc:
        raise NonFiniteTensor(f"{exc}; {_NONFINITE_HINTS[allow_nonfinite]}") from None
    return path, plan


# What to do about NaN/inf weights: without --allow-nonfinite they stop any step; with it
# only profiling (the reference engine) still refuses them.
_NONFINITE_HINTS = {
    False: "pass --allow-nonfinite to convert anyway",
    True: "profiling needs finite weights; convert with --no-sparsity (or --dense) to write them as they are",
}
