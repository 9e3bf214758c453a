"""Building a ``RuntimeModel`` from a model file and, optionally, its GPU split file."""

from __future__ import annotations

import contextlib
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from gguf import MODEL_TENSOR as T
from gguf import GGMLQuantizationType

from powerinfer_tools import kernels
from powerinfer_tools.direct_io import DirectReader
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.activation_thresholds import LayerThresholds, read_thresholds
from powerinfer_tools.formats.constants import (
    MODEL_FINGERPRINT_KEY,
    SPARSE_THRESHOLD_KEY,
    PowerInferTensor,
    TensorKind,
    block_part,
    predictor_names,
    tensor_name,
)
from powerinfer_tools.formats.ffn_bundle import BundleLayout
from powerinfer_tools.formats.gguf_names import fused_parts
from powerinfer_tools.formats.gpu_split import GpuSplit, default_split_path, read_gpu_split
from powerinfer_tools.formats.model_check import (check_finite, check_model_tensors, neuron_frequencies,
                                                  routing_frequencies)
from powerinfer_tools.formats.model_file import ModelFile, StoredTensor, open_model_file
from powerinfer_tools.formats.model_spec import ModelSpec
from powerinfer_tools.formats.quantization import decode, storage_shape
from powerinfer_tools.kernels.interleaved import InterleavedQ4
from powerinfer_tools.kernels.kernel_thread import runs_model_work
from powerinfer_tools.kernels.quant import SUPPORTED_TYPES, QuantMatrix
from powerinfer_tools.models import spec_from_model_file
from powerinfer_tools.models.base import EXTRA_NORMS
from powerinfer_tools.models.layers import Norm
from powerinfer_tools.runtime.backends import CpuBackend, CudaDevice, EmulatedDevice, OverBudget
from powerinfer_tools.runtime.engine import DenseBlock, Expert, RuntimeLayer, RuntimeModel
from powerinfer_tools.runtime.ffn import FFNPartition, Predictor
from powerinfer_tools.runtime.gate_choice import NeuronChoice, gate_choices
from powerinfer_tools.runtime.neuron_cache import DEFAULT_POLICY, NeuronCache, NeuronFile, RowSource
from powerinfer_tools.runtime.ram_budget import DEFAULT_CACHE_SHARE, RamPlan, RamState, plan_from_split, plan_ram

DOWN_T = PowerInferTensor.FFN_DOWN_T
# A CATS layer that keeps at least this share of its neurons (the file's calibrated mean) reads its up matrix whole,
# interleaved beside the gate, rather than the chosen rows. One token's scattered q4_0 rows are read at about half
# the rate of an interleaved matrix where part of a row goes through ggml's vec_dot (SmolLM2's 576 columns: four
# VNNI groups and two blocks; examples/decode_breakdown.py measures both), so past half of the rows the
# whole matrix takes less time; rows the VNNI row product takes whole (``kernels.vnni_rows``) come near the whole
# matrix's rate (Gemma 3's 640 columns at 80% kept: as fast either way, examples/prompt_ab.py --decode). The
# interleaved copy replaces the rows: no memory is added.
WHOLE_UP_SHARE = 0.5
WHOLE_UP_SHARE_VNNI_ROWS = 0.85


class _Tensors:
    """Typed access to a model file's tensors, uploaded to a backend on request.

    With a ``reader`` (a RAM budget), a tensor's bytes are read once with direct I/O into memory of
    our own, so that the weights in memory are exactly what the budget counts (``resident_bytes``);
    otherwise they are the memory-mapped file's pages. The parts of a fused tensor (Phi-3's attn_qkv) are tensors
    of their own here, views of its rows (``gguf_names.fused_parts``)."""

    def __init__(self, model: ModelFile, spec: ModelSpec, reader: DirectReader | None = None):
        self.model = model
        self._tensors = {**model.tensors, **fused_parts(spec, model.tensors)}
        self.bundle = BundleLayout.of_file(model)
        self.reader = reader
        self._copies: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> StoredTensor:
        return self._tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def stored(self, name: str) -> np.ndarray:
        """A tensor's stored array: the mapped file's, or the copy read for the RAM budget."""
        t = self[name]
        if self.reader is None:
            return t.data
        if name not in self._copies:
            raw = self.reader.read_range(t.offset, t.nbytes)
            self._copies[name] = np.frombuffer(raw, dtype=t.data.dtype).reshape(t.data.shape)
        return self._copies[name]

    @property
    def resident_bytes(self) -> int:
        return sum(a.nbytes for a in self._copies.values())

    def check_type(self, name: str, qtype: GGMLQuantizationType) -> None:
        if qtype not in SUPPORTED_TYPES:
            supported = ", ".join(q.name for q in SUPPORTED_TYPES)
            raise PitoolsError(f"{self.model.path}: tensor {name} is stored as {qtype.name}, which the runtime "
                               f"cannot compute with (supported: {supported})")

    def embeddings(self, tied: bool) -> QuantMatrix | FileRows:
        """The token embedding: under a RAM budget, when the head does not multiply it (``tied``), rows read
        from the file as tokens come (one row a token: the table would take the memory of thousands of
        neurons, ~74 MB on the 7B shape at q4_0)."""
        name = tensor_name(T.TOKEN_EMBD)
        if self.reader is None or tied:
            return self.matrix(name)
        t = self[name]
        self.check_type(name, t.qtype)
        return FileRows(self.reader, t.qtype, t.offset, t.data.dtype, t.data.shape)

    def matrix(self, name: str, backend=None) -> QuantMatrix:
        t = self[name]
        self.check_type(name, t.qtype)
        data = self.stored(name)
        return QuantMatrix(t.qtype, data if backend is None else backend.upload(data))

    def whole_matrix(self, name: str, m: QuantMatrix | None = None) -> QuantMatrix | InterleavedQ4:
        """A host matrix (``m``, default the tensor ``name``) that is only ever multiplied whole: attention,
        an untied head, a dense file's FFN, a CATS gate. It gets the layout the CPU multiplies fastest
        (``kernels.for_whole_products``), whose copy takes the place of a RAM budget's copy; without a
        budget, the file pages it was made from leave the process's memory."""
        m = self.matrix(name) if m is None else m
        laid_out = kernels.for_whole_products(m)
        if laid_out is not m:
            if name in self._copies:  # read with direct I/O into memory of ours: the copy replaces it
                self._copies[name] = laid_out.data
            else:
                _release_file_pages(m.data)
        return laid_out

    def ffn_rows(self, tensor: TensorKind, layer: int, expert: int | None = None) -> tuple[GGMLQuantizationType, np.ndarray]:
        """The type and stored rows ``[d_ff, ...]`` of one of a layer's (or an expert's) FFN matrices, in
        either layout (a bundled file's are copied out of its bundle rows: the kernels read contiguous rows)."""
        qtype, _ = self.ffn_format(tensor, layer, expert)
        part = None if self.bundle is None else self.bundle.part(tensor)
        if part is None:
            return qtype, self.stored(tensor_name(tensor, layer, expert=expert))
        bundle = self[tensor_name(PowerInferTensor.FFN_BUNDLE, layer)].data
        return qtype, np.ascontiguousarray(self.bundle.view(bundle, part, self.d_model))

    @property
    def d_model(self) -> int:
        return self.model.get("{arch}.embedding_length")

    def ffn_format(self, tensor: TensorKind, layer: int, expert: int | None = None) -> tuple[GGMLQuantizationType, int]:
        """The type (one the kernels compute, checked) and bytes per row of one of a layer's FFN matrices."""
        part = None if self.bundle is None else self.bundle.part(tensor)
        if part is not None:
            self.check_type(tensor_name(PowerInferTensor.FFN_BUNDLE, layer), part.qtype)
            return part.qtype, part.nbytes
        t = self[tensor_name(tensor, layer, expert=expert)]
        self.check_type(t.name, t.qtype)
        return t.qtype, t.nbytes // t.shape[0]

    def has_ffn(self, tensor: TensorKind, layer: int, expert: int | None = None) -> bool:
        return (tensor_name(tensor, layer, expert=expert) in self
                or (self.bundle is not None and self.bundle.part(tensor) is not None))

    def array(self, name: str, backend=None) -> Optional[np.ndarray]:
        if name not in self:
            return None
        t = self[name]
        # A copy even of a float32 tensor: read in place, a norm's page at each step would map the whole large
        # folio of the page cache around it (up to 2 MiB of the neighbouring matrices; ``_release_mapped_pages``)
        v = np.array(decode(self.stored(name), t.qtype).reshape(t.shape), dtype=np.float32)
        if not np.isfinite(v).all():  # checked here at no cost; a matrix only once the logits show damage
            check_finite(self.model, [name])
        return v if backend is None else backend.upload(v)

    def norm(self, tensor: TensorKind, layer: int | None, backend) -> Norm:
        weight, bias = (self.array(tensor_name(tensor, layer, part), backend) for part in ("weight", "bias"))
        return Norm(weight, bias)


@dataclass(frozen=True)
class FileRows:
    """A matrix whose rows are read from the file with direct I/O when they are looked up (the token
    embedding under a RAM budget): ``dequantize_rows`` as ``QuantMatrix``'s."""

    reader: DirectReader
    qtype: GGMLQuantizationType
    offset: int  # of the first row in the file
    dtype: np.dtype  # of the stored rows
    shape: tuple[int, ...]  # stored

    def dequantize_rows(self, rows: np.ndarray) -> np.ndarray:
        row_bytes = int(np.prod(self.shape[1:])) * np.dtype(self.dtype).itemsize
        stored = [np.frombuffer(self.reader.read_range(self.offset + int(r) * row_bytes, row_bytes), self.dtype)
                  for r in np.asarray(rows).reshape(-1)]
        return QuantMatrix(self.qtype, np.stack(stored).reshape(-1, *self.shape[1:])).dequantize_rows()


def _file_mapping(data: np.ndarray) -> mmap.mmap | None:
    """The memory map ``data`` is a view of, where it is one and pages can be dropped from it."""
    mapping = data
    while mapping is not None and not isinstance(mapping, mmap.mmap):
        mapping = getattr(mapping, "base", None)
    return mapping if hasattr(mmap, "MADV_DONTNEED") else None


def _release_file_pages(data: np.ndarray) -> None:
    """Drop the whole pages of the file mapping under ``data`` from this process's resident memory
    (``madvise(MADV_DONTNEED)`` on the read-only map: they stay in the page cache and come back if
    touched), so that a matrix copied into another layout is not counted twice. Nothing happens to an
    array that is not a view of a memory-mapped file."""
    if (mapping := _file_mapping(data)) is None:
        return
    offset = data.ctypes.data - np.frombuffer(mapping, np.uint8).ctypes.data
    start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
    stop = (offset + data.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if stop > start:
        mapping.madvise(mmap.MADV_DONTNEED, start, stop - start)


def _release_mapped_pages(model: ModelFile) -> None:
    """Drop every page of ``model``'s file mapping from this process once the runtime has what it copies.
    What the runtime still reads in place (the head, embedding rows, a sparse FFN's rows) faults back as it is
    read; the rest would stay resident beside its copy. A fault maps the whole large folio of the page cache
    around the page (ext4's folios reach 2 MiB; Linux 6.18 maps them whole), so that reading one tensor brings
    in parts of its neighbours: loading had left 1 MiB of the TinyLlama shape's dense file resident, but its
    norms, read in place by each prompt, brought back 64 MiB of copied matrices around them."""
    any_tensor = next(iter(model.tensors.values()), None)  # one mapping holds them all
    if any_tensor is not None and (mapping := _file_mapping(any_tensor.data)) is not None:
        mapping.madvise(mmap.MADV_DONTNEED)


def _check_split(split: GpuSplit, model: ModelFile, n_layers: int, layer_neurons: int, split_path: Path) -> None:
    """The split fits the model: a mask per layer over its FFN's neurons (a mixture's: all its experts')."""
    if len(split.masks) != n_layers:
        raise PitoolsError(f"{split_path}: split has {len(split.masks)} layers, {model.path} has {n_layers}")
    for i, mask in enumerate(split.masks):
        if len(mask) != layer_neurons:
            raise PitoolsError(f"{split_path}: layer {i} splits {len(mask)} neurons, the model's FFN has "
                               f"{layer_neurons}")


def _partition(tensors: _Tensors, layer: int, neurons: np.ndarray, d_ff: int, backend,
               expert: int | None = None, whole_gate: bool = False, keeps: float = 0.0) -> FFNPartition:
    """The rows of ``neurons`` of one layer's FFN (or one expert's) on ``backend``: copied to a device, in
    place on the host. ``whole_gate``: the gate is always computed whole (CATS), so when the host has
    every neuron it gets ``whole_matrix``'s layout, and so does up where the rule keeps the share ``keeps`` of
    the neurons that makes it pay (``WHOLE_UP_SHARE``)."""
    sparse_layout = tensors.has_ffn(DOWN_T, layer, expert)
    if not backend.is_device:
        rows = np.arange(d_ff)

        def pick(tensor):
            return QuantMatrix(*tensors.ffn_rows(tensor, layer, expert))

        pick_bias = tensors.array
    else:
        if not sparse_layout:
            raise PitoolsError(f"{tensors.model.path}: a dense file (no {block_part(DOWN_T)}) cannot be split across devices")
        rows = np.full(d_ff, -1, dtype=np.int64)
        rows[neurons] = np.arange(len(neurons))

        def pick(tensor):
            qtype, data = tensors.ffn_rows(tensor, layer, expert)
            return QuantMatrix(qtype, backend.upload(np.ascontiguousarray(data[neurons])))

        def pick_bias(name):
            v = tensors.array(name)
            return None if v is None else backend.upload(v[neurons])

    gated = tensors.has_ffn(T.FFN_GATE, layer, expert)
    if sparse_layout:
        gate, up, down_t, down = pick(T.FFN_GATE) if gated else None, pick(T.FFN_UP), pick(DOWN_T), None
        if gated and whole_gate and not backend.is_device and len(neurons) == d_ff:
            gate = tensors.whole_matrix(tensor_name(T.FFN_GATE, layer, expert=expert), gate)
            if isinstance(gate, InterleavedQ4) and _reads_up_whole(keeps, up):  # the two computed in one pass
                up = tensors.whole_matrix(tensor_name(T.FFN_UP, layer, expert=expert), up)
    else:  # a dense file, on the host: its FFN is only ever computed whole
        gate, up, down = _whole_ffn(tensors, [T.FFN_GATE] * gated + [T.FFN_UP, T.FFN_DOWN], layer)
        down_t = None
    return FFNPartition(
        backend=backend,
        neurons=neurons,
        row_of=rows,
        up=up,
        down_t=down_t,
        down=down,
        gate=gate,
        gate_bias=pick_bias(tensor_name(T.FFN_GATE, layer, "bias", expert)),
        up_bias=pick_bias(tensor_name(T.FFN_UP, layer, "bias", expert)),
    )


def _whole_ffn(tensors: _Tensors, kinds: list[TensorKind], layer: int) -> list:
    """A dense file's FFN matrices (``kinds``), then None for an absent gate: interleaved together where
    every one of them can be (``_Tensors.whole_matrix``; the compiled path takes them as a set), else as
    stored."""
    names = [tensor_name(kind, layer) for kind in kinds]
    matrices = [tensors.matrix(name) for name in names]
    if all(kernels.interleaves(m) for m in matrices):
        matrices = [tensors.whole_matrix(name) for name in names]
    return [None] * (3 - len(matrices)) + matrices


@dataclass(frozen=True)
class CacheSetup:
    """What every FFN's neuron cache shares; the plan's entries are per FFN (``ModelSpec.ffn_units``:
    the layers, or each layer's experts)."""

    file: NeuronFile
    plan: RamPlan
    policy: str
    d_ff: int
    n_experts: int

    def unit(self, layer: int, expert: int | None) -> int:
        """The plan's index of a layer's FFN, or of one of its experts."""
        return layer if expert is None else layer * self.n_experts + expert


def _unit_masks(masks, spec) -> list[np.ndarray]:
    """A split's per-layer masks cut into one per FFN, in ``spec.ffn_units`` order (a mixture's are
    expert-major)."""
    return [unit_mask for mask in masks for unit_mask in mask.reshape(-1, spec.d_ff)]


def _ram_setup(path: Path, model: ModelFile, spec, file: NeuronFile, gpu_split: GpuSplit | None, split_path: Path,
               ram: int, policy: str, cache_share: float) -> CacheSetup:
    """The plan for a RAM budget: the split's RAM tier when it has one, else the hottest neurons pinned."""
    tensors, units, first = _Tensors(model, spec), spec.ffn_units, spec.ffn_units[0]
    if not tensors.has_ffn(DOWN_T, 0, first.expert):
        raise PitoolsError(f"{path}: --ram needs a PowerInfer file (neuron-major {block_part(DOWN_T)}); "
                           "this one is dense")
    ffn = {tensor_name(t, u.layer, expert=u.expert) for t in (T.FFN_GATE, T.FFN_UP, DOWN_T, PowerInferTensor.FFN_BUNDLE)
           for u in units}  # and below, what else is not held in memory
    if tensor_name(T.OUTPUT) in model:  # an untied embedding is read a row a token (``_Tensors.embeddings``)
        ffn.add(tensor_name(T.TOKEN_EMBD))
    dense_bytes = sum(t.nbytes for name, t in model.tensors.items() if name not in ffn)
    neuron_bytes = sum(tensors.ffn_format(t, 0, first.expert)[1] for t in (T.FFN_GATE, T.FFN_UP, DOWN_T)
                       if tensors.has_ffn(t, 0, first.expert))
    all_neurons = np.arange(spec.d_ff)
    cpu = [all_neurons] * len(units) if gpu_split is None else [all_neurons[~m] for m in _unit_masks(gpu_split.masks, spec)]
    if gpu_split is not None and gpu_split.ram_masks is not None:
        plan = plan_from_split(ram, dense_bytes, neuron_bytes, _unit_masks(gpu_split.ram_masks, spec),
                               gpu_split.cache_bytes or 0, cpu, str(split_path))
    else:
        # Each layer gets an equal share of the rows, its hottest neurons pinned (a mixture's by reads per token).
        freqs = [neuron_frequencies(model, spec, u.layer, u.expert) for u in units]
        routing = [routing_frequencies(model, spec, layer) for layer in range(spec.n_layers)] if spec.moe else None
        plan = plan_ram(ram, dense_bytes, neuron_bytes, cpu, freqs, cache_share, max(spec.n_experts, 1), routing)
    return CacheSetup(file, plan, policy, spec.d_ff, spec.n_experts)


def _row_sources(tensors: _Tensors, layer: int, present: list, expert: int | None = None) -> list[RowSource]:
    """Where the rows of a layer's (or an expert's) ``present`` FFN matrices lie in the file (matrix i =
    ``present[i]``): one source of bundle rows, or one per matrix."""
    if tensors.bundle is not None:
        bundle = tensors[tensor_name(PowerInferTensor.FFN_BUNDLE, layer)]
        parts = tuple((i, tensors.bundle.part(t).offset, tensors.bundle.part(t).nbytes) for i, t in enumerate(present))
        return [RowSource(bundle.offset, tensors.bundle.stride, max(o + n for _, o, n in parts), parts)]
    sources = []
    for i, tensor in enumerate(present):
        stored = tensors[tensor_name(tensor, layer, expert=expert)]
        row_bytes = stored.nbytes // stored.shape[0]
        sources.append(RowSource(stored.offset, row_bytes, row_bytes, ((i, 0, row_bytes),)))
    return sources


def _cached_partition(tensors: _Tensors, layer: int, neurons: np.ndarray, cache: CacheSetup, host,
                      expert: int | None = None) -> FFNPartition:
    """A layer's (or an expert's) CPU neurons through a neuron cache: its pinned rows and slots in memory
    of our own."""
    present = [t for t in (T.FFN_GATE, T.FFN_UP, DOWN_T) if tensors.has_ffn(t, layer, expert)]
    formats = [tensors.ffn_format(t, layer, expert) for t in present]
    unit = cache.unit(layer, expert)
    nc = NeuronCache(cache.file, _row_sources(tensors, layer, present, expert), [n for _, n in formats],
                     cache.d_ff, cache.plan.pinned[unit], cache.plan.capacity[unit], cache.policy)
    matrices = {}
    for tensor, (qtype, _), rows in zip(present, formats, nc.rows):
        dtype = storage_shape((1, tensors.d_model), qtype)[1]
        matrices[tensor] = QuantMatrix(qtype, rows if dtype == np.uint8 else rows.view(dtype))
    return FFNPartition(
        backend=host, neurons=neurons, row_of=nc.row_of, up=matrices[T.FFN_UP], down_t=matrices[DOWN_T],
        gate=matrices.get(T.FFN_GATE), gate_bias=tensors.array(tensor_name(T.FFN_GATE, layer, "bias", expert)),
        up_bias=tensors.array(tensor_name(T.FFN_UP, layer, "bias", expert)), cache=nc,
    )


def _predictor(tensors: _Tensors, layer: int, backend, on_device: bool, threshold: float,
               expert: int | None = None) -> Predictor | None:
    """A layer's (or an expert's) predictor on ``backend``, None when the file has none."""
    fc1_name, fc2_name = predictor_names(layer, expert)
    if fc1_name not in tensors:
        return None
    matrix_backend = backend if on_device else None  # in its stored type (PowerInfer's q5_0 too)
    return Predictor(backend, tensors.matrix(fc1_name, matrix_backend), tensors.matrix(fc2_name, matrix_backend),
                     threshold)


def _dense_block(tensors: _Tensors, layer: int, backend, on_device: bool, threshold: float,
                 thresholds: LayerThresholds | None) -> DenseBlock:
    """A layer's attention, norms, biases and predictor (or ``thresholds``) on ``backend`` (matrices uploaded
    only to a device)."""
    biases = {
        key: tensors.array(tensor_name(tensor, layer, "bias"), backend)
        for key, tensor in (("q", T.ATTN_Q), ("k", T.ATTN_K), ("v", T.ATTN_V), ("o", T.ATTN_OUT))
    }
    down_bias = tensors.array(tensor_name(DOWN_T, layer, "bias"), backend)
    if down_bias is None:
        down_bias = tensors.array(tensor_name(T.FFN_DOWN, layer, "bias"), backend)
    biases["down"] = down_bias
    wq, wk, wv, wo = (tensors.matrix(tensor_name(t, layer), backend) if on_device
                      else tensors.whole_matrix(tensor_name(t, layer)) for t in (T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.ATTN_OUT))
    return DenseBlock(
        backend=backend,
        attn_norm=tensors.norm(T.ATTN_NORM, layer, backend),
        wq=wq,
        wk=wk,
        wv=wv,
        wo=wo,
        ffn_norm=tensors.norm(T.FFN_NORM, layer, backend),
        biases={k: v for k, v in biases.items() if v is not None},
        **{field: tensors.norm(tensor, layer, backend) for field, tensor in EXTRA_NORMS.items()
           if tensor_name(tensor, layer) in tensors},
        predictor=_predictor(tensors, layer, backend, on_device, threshold),
        thresholds=thresholds,
    )


def _mixture_layer(tensors: _Tensors, layer: int, dense: DenseBlock, d_ff: int, threshold: float,
                   gpu_mask: np.ndarray | None, device, host, cache: CacheSetup | None) -> RuntimeLayer:
    """A layer whose FFN is a mixture of experts; its router lives with its dense block. In the sparse
    layout each expert is a layer's FFN of its own (tensors, predictor, and the split's slice of the
    layer's mask: expert-major); in a dense file each expert's matrices are its slice of the stacked
    ``*_exps`` tensors, computed on the host. Either way the host's rows stay in the memory map."""
    router = tensors.array(tensor_name(T.FFN_GATE_INP, layer), dense.backend)
    n_experts = len(router)
    if tensors.has_ffn(DOWN_T, layer, 0):
        masks = [None] * n_experts if gpu_mask is None else gpu_mask.reshape(n_experts, d_ff)
        experts = [Expert(_partitions(tensors, layer, d_ff, masks[e], device, host, cache, e),
                          _predictor(tensors, layer, dense.backend, dense.backend.is_device, threshold, e))
                   for e in range(n_experts)]
        return RuntimeLayer(layer, dense, [], d_ff, router=router, experts=experts)

    def expert_matrix(tensor: TensorKind, e: int) -> QuantMatrix:
        stored = tensors[tensor_name(tensor, layer)]
        tensors.check_type(stored.name, stored.qtype)
        return QuantMatrix(stored.qtype, stored.data[e])

    all_neurons = np.arange(d_ff)
    experts = [Expert([FFNPartition(host, all_neurons, all_neurons, up=expert_matrix(T.FFN_UP_EXP, e),
                                    down_t=None, down=expert_matrix(T.FFN_DOWN_EXP, e),
                                    gate=expert_matrix(T.FFN_GATE_EXP, e))])
               for e in range(n_experts)]
    return RuntimeLayer(layer, dense, [], d_ff, router=router, experts=experts)


def _partitions(tensors: _Tensors, layer: int, d_ff: int, gpu_mask: np.ndarray | None, device, host,
                cache: CacheSetup | None, expert: int | None = None, whole_gate: bool = False,
                keeps: float = 0.0) -> list:
    """A layer's FFN (or an expert's): the neurons ``gpu_mask`` marks on the device, the rest (all
    without a split) on the host, through a neuron cache under a RAM budget."""
    partitions = []
    all_neurons = np.arange(d_ff)
    if gpu_mask is not None and gpu_mask.any():
        partitions.append(_partition(tensors, layer, np.flatnonzero(gpu_mask), d_ff, device, expert))
        cold = all_neurons[~gpu_mask]
    else:
        cold = all_neurons
    if len(cold):
        partitions.append(_partition(tensors, layer, cold, d_ff, host, expert, whole_gate, keeps) if cache is None
                          else _cached_partition(tensors, layer, cold, cache, host, expert))
    return partitions


def _layer(tensors: _Tensors, spec, i: int, gpu_split: GpuSplit | None, device_backend, host,
           cache: CacheSetup | None, thresholds: LayerThresholds | None, keeps: float) -> RuntimeLayer:
    """Layer ``i``: its dense block where the split puts it (the device when it holds the layer's hot
    neurons, unless the split says otherwise), its FFN partitions or its experts; ``thresholds`` choose its
    neurons in sparse mode, instead of its predictor, keeping about the share ``keeps`` of them."""
    on_device = gpu_split is not None and (
        gpu_split.dense_on_gpu[i] if gpu_split.dense_on_gpu else gpu_split.masks[i].any()
    )
    backend = device_backend if on_device else host
    threshold = float(tensors.model.get(SPARSE_THRESHOLD_KEY, 0.0))
    dense = _dense_block(tensors, i, backend, on_device, threshold, thresholds)
    gpu_mask = gpu_split.masks[i] if gpu_split is not None else None
    if spec.moe:
        return _mixture_layer(tensors, i, dense, spec.d_ff, threshold, gpu_mask, device_backend, host, cache)
    cats = dense.thresholds is not None and dense.thresholds.cats is not None
    return RuntimeLayer(i, dense, _partitions(tensors, i, spec.d_ff, gpu_mask, device_backend, host, cache,
                                              whole_gate=cats, keeps=keeps), spec.d_ff)


def _check_fingerprint(gpu_split: GpuSplit, model: ModelFile, split_path: Path) -> None:
    """A split named by the caller must have been solved for this model file, when it records which (PowerInfer's
    do not): one of another file of the same shape would load and place neurons by that file's profile."""
    if gpu_split.model_fingerprint not in (None, model.fingerprint()):
        raise PitoolsError(f"{split_path}: solved for another model file than {model.path} ({MODEL_FINGERPRINT_KEY} "
                           f"differs); solve one for it: pitools solve {model.path} --vram SIZE")


def _open_split(split_path: Path, model: ModelFile, n_layers: int, layer_neurons: int, device: str,
                named: bool) -> tuple[GpuSplit, object]:
    """The split file, checked against the model (``named``: by the caller, also its fingerprint), and the device
    its budget allows."""
    gpu_split = read_gpu_split(split_path)
    if named:
        _check_fingerprint(gpu_split, model, split_path)
    _check_split(gpu_split, model, n_layers, layer_neurons, split_path)
    budget = gpu_split.vram_budget if gpu_split.vram_budget is not None else gpu_split.vram_capacity
    return gpu_split, CudaDevice(budget) if device == "cuda" else EmulatedDevice(budget)


@runs_model_work  # its copies into other layouts run the kernels' parallel loops (``kernel_thread``)
def load_runtime_model(
    path: str | Path | ModelFile,
    split: str | Path | None = None,
    use_split: bool = True,
    device: str = "emulated",
    context_size: Optional[int] = None,
    ram: Optional[int] = None,
    cache_policy: str = DEFAULT_POLICY,
    cache_share: float = DEFAULT_CACHE_SHARE,
    cpu_only: bool = False,
    neuron_choice: NeuronChoice | str = NeuronChoice.AUTO,
) -> RuntimeModel:
    """Open ``path`` (or take it open: ``open_model_file``'s) for the runtime, for sequences of up to
    ``context_size`` positions (default: the model's trained positions).

    With ``use_split``, the split file ``split`` (default: beside the model) places
    each layer's hot neurons, and its dense block where the solver put it, on the
    device: ``cuda`` (CuPy) or ``emulated`` (see ``EmulatedDevice``). Without a
    split everything runs on the CPU. With ``ram`` (bytes), the weights in memory stay within it:
    the CPU neurons go through neuron caches (``neuron_cache``, planned by ``ram_budget``, evicting
    by ``cache_policy``), and nothing is read through the memory map. ``cpu_only``: a split is used only
    for its RAM tier, and one that places neurons on a GPU is refused. ``neuron_choice``: what chooses a ReLU
    family's neurons in sparse mode, each layer's predictor or its whole gate (``gate_choice``).
    """
    model = path if isinstance(path, ModelFile) else open_model_file(path)
    path = model.path
    spec = spec_from_model_file(model)
    check_model_tensors(model, spec)
    host = CpuBackend()

    split_path = Path(split) if split is not None else default_split_path(path)
    gpu_split, device_backend = None, None
    if use_split and (split is not None or split_path.is_file()):
        gpu_split, device_backend = _open_split(split_path, model, spec.n_layers, spec.d_ff * max(spec.n_experts, 1),
                                                device, named=split is not None)
        if cpu_only:
            if any(mask.any() for mask in gpu_split.masks) or gpu_split.ram_masks is None:
                raise PitoolsError(f"{split_path}: places neurons on a GPU, and this run is on the CPU: give --device "
                                   "cuda, or --no-split")
            device_backend = None
    tensors, cache = _Tensors(model, spec), None
    layer_thresholds, keeps = _layer_thresholds(model, spec, ram, neuron_choice)
    if ram is not None:
        file = NeuronFile(path)
        cache = _ram_setup(path, model, spec, file, gpu_split, split_path, ram, cache_policy, cache_share)
        tensors = _Tensors(model, spec, file.reader)

    with _within_split_budget(split_path, path):
        layers = [_layer(tensors, spec, i, gpu_split, device_backend, host, cache, layer_thresholds[i], keeps)
                  for i in range(spec.n_layers)]
        runtime = _runtime_model(tensors, spec, layers, gpu_split, device_backend, host, split_path, path,
                                 context_size)
    _release_mapped_pages(model)
    if cache is not None:
        caches = [p.cache for layer in layers for ffn in ([e.partitions for e in layer.experts] or [layer.partitions])
                  for p in ffn if p.cache is not None]
        runtime.ram = RamState(cache.plan, tensors.resident_bytes, caches, cache.file)
    return runtime


def _layer_thresholds(model: ModelFile, spec, ram: int | None, neuron_choice) -> tuple[list[LayerThresholds | None],
                                                                                      float]:
    """Per layer, what chooses its neurons in sparse mode instead of a predictor: a SiLU model's thresholds, or a
    ReLU family's whole gate (``gate_choice``); None where the predictor does. Then the share of the neurons
    the file's thresholds keep (calibrated for), 0 for a gate's choice (which keeps those that fire: a tenth)."""
    thresholds = read_thresholds(model.get, spec.n_layers, str(model.path))
    if ram is not None and thresholds is not None:
        raise PitoolsError(f"{model.path}: a thresholded model ({thresholds.rule.value}) under a RAM budget (--ram) "
                           "is not supported yet: its neuron choice reads every gate row")
    gate_chooses = gate_choices(model, spec, neuron_choice, ram)  # checked even where thresholds choose
    if thresholds is None:
        return gate_chooses, 0.0
    return list(thresholds.layers), 1 - thresholds.target


def _reads_up_whole(keeps: float, up: QuantMatrix) -> bool:
    """Whether a CATS layer keeping the share ``keeps`` of its neurons takes less time reading ``up`` whole than
    reading the rows it keeps (``WHOLE_UP_SHARE``)."""
    return kernels.interleaves(up) and keeps >= (WHOLE_UP_SHARE_VNNI_ROWS if kernels.vnni_rows(up) else WHOLE_UP_SHARE)


@contextlib.contextmanager
def _within_split_budget(split_path: Path, path: Path):
    """An upload past the device's budget: the split's own placement does not fit the budget it records."""
    try:
        yield
    except OverBudget as exc:
        raise PitoolsError(f"{split_path}: places more on the device than its VRAM budget ({exc}); "
                           f"solve it again: pitools solve {path} --vram SIZE") from None


def _runtime_model(tensors: _Tensors, spec, layers: list, gpu_split: GpuSplit | None, device_backend, host,
                   split_path: Path, path: Path, context_size: Optional[int]) -> RuntimeModel:
    """The model around its layers: embeddings and the head, placed where the split says."""
    model = tensors.model
    # The solver may place the head (output norm and matrix) on the device: then the last hidden
    # state crosses PCIe instead of the logits being computed from host memory.
    head = device_backend if gpu_split is not None and gpu_split.output_on_gpu else host
    output_name = tensor_name(T.OUTPUT)
    tied = output_name not in tensors
    if not tied:
        output = tensors.whole_matrix(output_name) if head is host else tensors.matrix(output_name, head)
    else:  # the embedding, whose rows are also looked up one by one
        output = tensors.matrix(tensor_name(T.TOKEN_EMBD), None if head is host else head)
    return RuntimeModel(
        spec,
        layers,
        token_embd=tensors.embeddings(tied),
        output_norm=tensors.norm(T.OUTPUT_NORM, None, head) if tensor_name(T.OUTPUT_NORM) in model else None,
        output=output,
        positions=tensors.array(tensor_name(T.POS_EMBD)),
        device=device_backend,
        split_path=split_path if gpu_split is not None else None,
        metadata=model.metadata,
        fingerprint=model.fingerprint(),
        head_backend=head,
        host=host,
        path=path,
        context_size=context_size,
    )
