"""Building a ``RuntimeModel`` from a model file and, optionally, its GPU split file."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from ..errors import PitoolsError
from ..formats.gguf_spec import spec_from_model_file
from ..formats.model_check import check_model_tensors
from ..formats.gpu_split import GpuSplit, read_gpu_split
from ..formats.model_file import ModelFile, open_model_file
from ..kernels.quant import SUPPORTED_TYPES, QuantMatrix
from ..solver.split import default_split_path
from .backends import CpuBackend, CudaDevice, EmulatedDevice
from .engine import DenseBlock, Norm, RuntimeLayer, RuntimeModel
from .ffn import FFNPartition, Predictor

SPARSE_THRESHOLD_KEY = "powerinfer.sparse_threshold"


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

    def array(self, name: str, backend=None) -> Optional[np.ndarray]:
        if name not in self.model:
            return None
        v = np.ascontiguousarray(self.model[name].dequantize(), dtype=np.float32)
        return v if backend is None else backend.upload(v)

    def norm(self, prefix: str, backend) -> Norm:
        return Norm(self.array(f"{prefix}.weight", backend), self.array(f"{prefix}.bias", backend))


def _check_split(split: GpuSplit, model: ModelFile, n_layers: int, d_ff: int, split_path: Path) -> None:
    if len(split.masks) != n_layers:
        raise PitoolsError(f"{split_path}: split has {len(split.masks)} layers, {model.path} has {n_layers}")
    for i, mask in enumerate(split.masks):
        if len(mask) != d_ff:
            raise PitoolsError(f"{split_path}: layer {i} splits {len(mask)} neurons, the model's FFN has {d_ff}")


def _partition(tensors: _Tensors, block: str, neurons: np.ndarray, d_ff: int, backend) -> FFNPartition:
    """The rows of ``neurons`` of one layer's FFN on ``backend``: copied to a device, in place on the host."""
    has_gate = f"{block}.ffn_gate.weight" in tensors.model
    sparse_layout = f"{block}.ffn_down_t.weight" in tensors.model
    if not backend.is_device:
        rows = np.arange(d_ff)
        pick = lambda name: tensors.matrix(name)  # noqa: E731
        pick_bias = tensors.array
    else:
        if not sparse_layout:
            raise PitoolsError(f"{tensors.model.path}: a dense file (no ffn_down_t) cannot be split across devices")
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
        up=pick(f"{block}.ffn_up.weight"),
        down_t=pick(f"{block}.ffn_down_t.weight") if sparse_layout else None,
        down=None if sparse_layout else tensors.matrix(f"{block}.ffn_down.weight"),
        gate=pick(f"{block}.ffn_gate.weight") if has_gate else None,
        gate_bias=pick_bias(f"{block}.ffn_gate.bias"),
        up_bias=pick_bias(f"{block}.ffn_up.bias"),
    )


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

    gpu_split, device_backend = None, None
    split_path = Path(split) if split is not None else default_split_path(path)
    if use_split and (split is not None or split_path.is_file()):
        gpu_split = read_gpu_split(split_path)
        _check_split(gpu_split, model, spec.n_layers, spec.d_ff, split_path)
        budget = int(gpu_split.extra.get("pitools.vram_budget", gpu_split.vram_capacity))
        device_backend = CudaDevice(budget) if device == "cuda" else EmulatedDevice(budget)
    dense_on_gpu = list(gpu_split.extra.get("pitools.dense_on_gpu", [])) if gpu_split else []

    threshold = float(model.get(SPARSE_THRESHOLD_KEY, 0.0))
    layers = []
    for i in range(spec.n_layers):
        block = f"blk.{i}"
        on_device = gpu_split is not None and (bool(dense_on_gpu[i]) if dense_on_gpu else gpu_split.masks[i].any())
        backend = device_backend if on_device else host
        biases = {
            key: tensors.array(f"{block}.{name}.bias", backend)
            for key, name in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output"))
        }
        down_bias = tensors.array(f"{block}.ffn_down_t.bias", backend)
        if down_bias is None:
            down_bias = tensors.array(f"{block}.ffn_down.bias", backend)
        biases["down"] = down_bias
        predictor = None
        if f"{block}.fc1.weight" in model:
            fc1, fc2 = (tensors.array(f"{block}.{n}.weight", backend) for n in ("fc1", "fc2"))
            predictor = Predictor(fc1, fc2, threshold)
        dense = DenseBlock(
            backend=backend,
            attn_norm=tensors.norm(f"{block}.attn_norm", backend),
            wq=tensors.matrix(f"{block}.attn_q.weight", backend if on_device else None),
            wk=tensors.matrix(f"{block}.attn_k.weight", backend if on_device else None),
            wv=tensors.matrix(f"{block}.attn_v.weight", backend if on_device else None),
            wo=tensors.matrix(f"{block}.attn_output.weight", backend if on_device else None),
            ffn_norm=tensors.norm(f"{block}.ffn_norm", backend),
            biases={k: v for k, v in biases.items() if v is not None},
            predictor=predictor,
        )
        partitions = []
        all_neurons = np.arange(spec.d_ff)
        if gpu_split is not None and gpu_split.masks[i].any():
            hot = gpu_split.bucket(i).astype(np.int64)
            partitions.append(_partition(tensors, block, hot, spec.d_ff, device_backend))
            cold = all_neurons[~gpu_split.masks[i]]
        else:
            cold = all_neurons
        if len(cold):
            partitions.append(_partition(tensors, block, cold, spec.d_ff, host))
        layers.append(RuntimeLayer(dense, partitions, spec.d_ff))

    # The solver may place the head (output norm and matrix) on the device: then the last hidden
    # state crosses PCIe instead of the logits being computed from host memory.
    head = device_backend if gpu_split is not None and gpu_split.extra.get("pitools.output_on_gpu") else host
    output_name = "output.weight" if "output.weight" in model else "token_embd.weight"  # tied: the embedding
    output = tensors.matrix(output_name, None if head is host else head)
    return RuntimeModel(
        spec,
        layers,
        token_embd=tensors.matrix("token_embd.weight"),
        output_norm=tensors.norm("output_norm", head) if "output_norm.weight" in model else None,
        output=output,
        positions=tensors.array("position_embd.weight"),
        device=device_backend,
        split_path=split_path if gpu_split is not None else None,
        metadata=model.metadata,
        head_backend=head,
        host=host,
        path=path,
        context_size=context_size,
    )
