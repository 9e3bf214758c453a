"""Building a ``RuntimeModel`` from a model file and, optionally, its GPU split file."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
from gguf import MODEL_TENSOR as T
from gguf import GGMLQuantizationType

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.constants import (
    SPARSE_THRESHOLD_KEY,
    PowerInferTensor,
    TensorKind,
    block_part,
    predictor_names,
    tensor_name,
)
from powerinfer_tools.formats.gguf_spec import spec_from_model_file
from powerinfer_tools.formats.gpu_split import GpuSplit, default_split_path, read_gpu_split
from powerinfer_tools.formats.model_check import check_model_tensors
from powerinfer_tools.formats.model_file import ModelFile, open_model_file
from powerinfer_tools.kernels.quant import SUPPORTED_TYPES, QuantMatrix
from powerinfer_tools.models.layers import Norm
from powerinfer_tools.runtime.backends import CpuBackend, CudaDevice, EmulatedDevice
from powerinfer_tools.runtime.engine import DenseBlock, RuntimeLayer, RuntimeModel
from powerinfer_tools.runtime.ffn import FFNPartition, Predictor

DOWN_T = PowerInferTensor.FFN_DOWN_T


class _Tensors:
    """Typed access to a model file's tensors, uploaded to a backend on request."""

    def __init__(self, model: ModelFile):
        self.model = model

    def matrix(self, name: str, backend=None) -> QuantMatrix:
        t = self.model[name]
        if t.qtype not in SUPPORTED_TYPES:
            supported = ", ".join(q.name for q in SUPPORTED_TYPES)
            raise PitoolsError(f"{self.model.path}: tensor {name} is stored as {t.qtype.name}, which the runtime "
                               f"cannot compute with (supported: {supported})")
        data = t.data if backend is None else backend.upload(t.data)
        return QuantMatrix(t.qtype, data)

    def predictor_matrix(self, name: str, backend=None) -> QuantMatrix:
        """A predictor tensor in its stored type; one the kernels do not compute (the q5_0 of PowerInfer's own
        quantizer) becomes f16 at load: as compact as a weight type the kernels compute, within f16 rounding."""
        t = self.model[name]
        if t.qtype in SUPPORTED_TYPES:
            return self.matrix(name, backend)
        data = t.dequantize().astype(np.float16)
        return QuantMatrix(GGMLQuantizationType.F16, data if backend is None else backend.upload(data))

    def array(self, name: str, backend=None) -> Optional[np.ndarray]:
        if name not in self.model:
            return None
        v = np.ascontiguousarray(self.model[name].dequantize(), dtype=np.float32)
        return v if backend is None else backend.upload(v)

    def norm(self, tensor: TensorKind, layer: int | None, backend) -> Norm:
        weight, bias = (self.array(tensor_name(tensor, layer, part), backend) for part in ("weight", "bias"))
        return Norm(weight, bias)


def _check_split(split: GpuSplit, model: ModelFile, n_layers: int, d_ff: int, split_path: Path) -> None:
    if len(split.masks) != n_layers:
        raise PitoolsError(f"{split_path}: split has {len(split.masks)} layers, {model.path} has {n_layers}")
    for i, mask in enumerate(split.masks):
        if len(mask) != d_ff:
            raise PitoolsError(f"{split_path}: layer {i} splits {len(mask)} neurons, the model's FFN has {d_ff}")


def _partition(tensors: _Tensors, layer: int, neurons: np.ndarray, d_ff: int, backend) -> FFNPartition:
    """The rows of ``neurons`` of one layer's FFN on ``backend``: copied to a device, in place on the host."""
    has_gate = tensor_name(T.FFN_GATE, layer) in tensors.model
    sparse_layout = tensor_name(DOWN_T, layer) in tensors.model
    if not backend.is_device:
        rows = np.arange(d_ff)
        pick = lambda name: tensors.matrix(name)  # noqa: E731
        pick_bias = tensors.array
    else:
        if not sparse_layout:
            raise PitoolsError(f"{tensors.model.path}: a dense file (no {block_part(DOWN_T)}) cannot be split across devices")
        rows = np.full(d_ff, -1, dtype=np.int64)
        rows[neurons] = np.arange(len(neurons))

        def pick(name):
            t = tensors.model[name]
            return QuantMatrix(t.qtype, backend.upload(np.ascontiguousarray(t.data[neurons])))

        def pick_bias(name):
            v = tensors.array(name)
            return None if v is None else backend.upload(v[neurons])

    return FFNPartition(
        backend=backend,
        neurons=neurons,
        row_of=rows,
        up=pick(tensor_name(T.FFN_UP, layer)),
        down_t=pick(tensor_name(DOWN_T, layer)) if sparse_layout else None,
        down=None if sparse_layout else tensors.matrix(tensor_name(T.FFN_DOWN, layer)),
        gate=pick(tensor_name(T.FFN_GATE, layer)) if has_gate else None,
        gate_bias=pick_bias(tensor_name(T.FFN_GATE, layer, "bias")),
        up_bias=pick_bias(tensor_name(T.FFN_UP, layer, "bias")),
    )


def _dense_block(tensors: _Tensors, layer: int, backend, on_device: bool, threshold: float) -> DenseBlock:
    """A layer's attention, norms, biases and predictor on ``backend`` (matrices uploaded only to a device)."""
    biases = {
        key: tensors.array(tensor_name(tensor, layer, "bias"), backend)
        for key, tensor in (("q", T.ATTN_Q), ("k", T.ATTN_K), ("v", T.ATTN_V), ("o", T.ATTN_OUT))
    }
    down_bias = tensors.array(tensor_name(DOWN_T, layer, "bias"), backend)
    if down_bias is None:
        down_bias = tensors.array(tensor_name(T.FFN_DOWN, layer, "bias"), backend)
    biases["down"] = down_bias
    predictor = None
    fc1_name, fc2_name = predictor_names(layer)
    matrix_backend = backend if on_device else None
    if fc1_name in tensors.model:
        predictor = Predictor(backend, tensors.predictor_matrix(fc1_name, matrix_backend),
                              tensors.predictor_matrix(fc2_name, matrix_backend), threshold)
    return DenseBlock(
        backend=backend,
        attn_norm=tensors.norm(T.ATTN_NORM, layer, backend),
        wq=tensors.matrix(tensor_name(T.ATTN_Q, layer), matrix_backend),
        wk=tensors.matrix(tensor_name(T.ATTN_K, layer), matrix_backend),
        wv=tensors.matrix(tensor_name(T.ATTN_V, layer), matrix_backend),
        wo=tensors.matrix(tensor_name(T.ATTN_OUT, layer), matrix_backend),
        ffn_norm=tensors.norm(T.FFN_NORM, layer, backend),
        biases={k: v for k, v in biases.items() if v is not None},
        predictor=predictor,
    )


def _partitions(tensors: _Tensors, layer: int, d_ff: int, gpu_split: GpuSplit | None, device, host) -> list:
    """A layer's FFN: the split's hot neurons on the device, the rest (all without a split) on the host."""
    partitions = []
    all_neurons = np.arange(d_ff)
    if gpu_split is not None and gpu_split.masks[layer].any():
        hot = gpu_split.bucket(layer).astype(np.int64)
        partitions.append(_partition(tensors, layer, hot, d_ff, device))
        cold = all_neurons[~gpu_split.masks[layer]]
    else:
        cold = all_neurons
    if len(cold):
        partitions.append(_partition(tensors, layer, cold, d_ff, host))
    return partitions


def _open_split(split_path: Path, model: ModelFile, n_layers: int, d_ff: int, device: str) -> tuple[GpuSplit, object]:
    """The split file, checked against the model, and the device its budget allows."""
    gpu_split = read_gpu_split(split_path)
    _check_split(gpu_split, model, n_layers, d_ff, split_path)
    budget = gpu_split.vram_budget if gpu_split.vram_budget is not None else gpu_split.vram_capacity
    return gpu_split, CudaDevice(budget) if device == "cuda" else EmulatedDevice(budget)


def load_runtime_model(
    path: str | Path,
    split: str | Path | None = None,
    use_split: bool = True,
    device: str = "emulated",
    context_size: Optional[int] = None,
) -> RuntimeModel:
    """Open ``path`` for the runtime, for sequences of up to ``context_size`` positions (default: the
    model's trained positions).

    With ``use_split``, the split file ``split`` (default: beside the model) places
    each layer's hot neurons, and its dense block where the solver put it, on the
    device: ``cuda`` (CuPy) or ``emulated`` (see ``EmulatedDevice``). Without a
    split everything runs on the CPU.
    """
    path = Path(path)
    model = open_model_file(path)
    spec = spec_from_model_file(model)
    check_model_tensors(model, spec)
    tensors = _Tensors(model)
    host = CpuBackend()

    split_path = Path(split) if split is not None else default_split_path(path)
    gpu_split, device_backend = None, None
    if use_split and (split is not None or split_path.is_file()):
        gpu_split, device_backend = _open_split(split_path, model, spec.n_layers, spec.d_ff, device)

    threshold = float(model.get(SPARSE_THRESHOLD_KEY, 0.0))
    layers = []
    for i in range(spec.n_layers):
        on_device = gpu_split is not None and (
            gpu_split.dense_on_gpu[i] if gpu_split.dense_on_gpu else gpu_split.masks[i].any()
        )
        backend = device_backend if on_device else host
        dense = _dense_block(tensors, i, backend, on_device, threshold)
        layers.append(RuntimeLayer(dense, _partitions(tensors, i, spec.d_ff, gpu_split, device_backend, host), spec.d_ff))

    # The solver may place the head (output norm and matrix) on the device: then the last hidden
    # state crosses PCIe instead of the logits being computed from host memory.
    head = device_backend if gpu_split is not None and gpu_split.output_on_gpu else host
    output_name = tensor_name(T.OUTPUT)
    if output_name not in model:  # tied: the embedding
        output_name = tensor_name(T.TOKEN_EMBD)
    output = tensors.matrix(output_name, None if head is host else head)
    return RuntimeModel(
        spec,
        layers,
        token_embd=tensors.matrix(tensor_name(T.TOKEN_EMBD)),
        output_norm=tensors.norm(T.OUTPUT_NORM, None, head) if tensor_name(T.OUTPUT_NORM) in model else None,
        output=output,
        positions=tensors.array(tensor_name(T.POS_EMBD)),
        device=device_backend,
        split_path=split_path if gpu_split is not None else None,
        metadata=model.metadata,
        head_backend=head,
        host=host,
        path=path,
        context_size=context_size,
    )
