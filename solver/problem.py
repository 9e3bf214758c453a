"""The placement problem: what may go on the GPU, what it takes there, and what it costs per token.

Memory model. Everything resident on the GPU counts against the budget:

* a fixed reserve for the CUDA context, cuBLAS workspace and compute scratch buffers
  (``DEFAULT_RESERVE_BYTES``, 512 MiB: a CUDA context alone takes 300-500 MiB on recent drivers);
* per layer, its dense block when placed there: attention weights and norms, the neuron
  predictor (all read every token, so they are the hottest bytes of the layer), and the
  layer's KV cache for ``--ctx`` tokens;
* per layer, the rows of ``ffn_gate``, ``ffn_up`` and ``ffn_down`` of its GPU neurons, at the
  model file's quantization (``neuron_bytes`` per neuron);
* the output head (output norm and output matrix) when placed there. Token embeddings stay in
  host memory: a token reads one row of them.

FFN neurons of a layer go to the GPU only with the layer's dense block, as in PowerInfer,
which offloads dense tensors before it splits any FFN.

Cost model. Decoding is memory-bound, so reading ``n`` bytes from a device takes
``n / bandwidth``. Per token and layer: the dense block is read on its device (the KV cache
at half fill, the average over a generation that fills the context); then the FFN runs on
both devices at once, each reading the rows of its neurons that fire (firing probabilities
come from profiling), so it takes the longer of the two; a layer whose work spans both
devices pays one hand-off (sync latency plus copying the activation vector each way over
PCIe). Device switches between consecutive unsplit layers are not charged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from powerinfer_tools.solver.hardware import HardwareProfile

from powerinfer_tools.errors import PitoolsError

DEFAULT_RESERVE_BYTES = 512 * 2**20

# Names of the per-model inputs of ``problem_from_stats``; also the arrays of a ``--stats`` file.
STATS_KEYS = (
    "freqs", "neuron_bytes", "dense_bytes", "predictor_bytes", "kv_bytes_per_token", "head_bytes", "hidden_bytes",
)


@dataclass(frozen=True, eq=False)
class Layer:
    """One transformer layer, its FFN neurons sorted from the most to the least active."""

    freqs: np.ndarray  # firing probability per token of each neuron, descending
    order: np.ndarray  # order[i] is the neuron id of the i-th most active neuron
    neuron_bytes: int  # one neuron's rows of gate, up and down at the file's quantization
    dense_bytes: int  # attention weights and norms: read every token
    predictor_bytes: int  # the neuron predictor: read every token
    kv_bytes: int  # KV cache at the context length: read at half fill on average
    min_gpu_neurons: int  # a split layer puts at least this many neurons on the GPU

    @property
    def n_neurons(self) -> int:
        return len(self.freqs)

    @cached_property
    def cumulative_freqs(self) -> np.ndarray:
        """``cumulative_freqs[k]``: expected firing neurons among the ``k`` most active."""
        return np.concatenate(([0.0], np.cumsum(self.freqs, dtype=np.float64)))

    @property
    def block_bytes(self) -> int:
        """What the dense block (weights, predictor, KV cache) takes on the GPU."""
        return self.dense_bytes + self.predictor_bytes + self.kv_bytes

    @property
    def dense_read_bytes(self) -> float:
        return self.dense_bytes + self.predictor_bytes + self.kv_bytes / 2


@dataclass(frozen=True)
class PlacementProblem:
    layers: tuple[Layer, ...]
    head_bytes: int  # output norm and output matrix: read every token
    hidden_bytes: int  # one activation vector, copied each way when a layer is split
    budget_bytes: int
    hardware: HardwareProfile
    n_ctx: int  # context length the KV caches are sized for
    reserve_bytes: int = DEFAULT_RESERVE_BYTES

    def gpu_seconds(self, nbytes: float) -> float:
        return nbytes / (self.hardware.gpu_bandwidth_gbs * 1e9)

    def cpu_seconds(self, nbytes: float) -> float:
        return nbytes / (self.hardware.cpu_bandwidth_gbs * 1e9)

    @property
    def sync_seconds(self) -> float:
        hw = self.hardware
        return hw.sync_latency_us * 1e-6 + 2 * self.hidden_bytes / (hw.pcie_bandwidth_gbs * 1e9)

    def smallest_gpu_unit(self) -> tuple[str, int]:
        """The smallest thing that moves work to the GPU: (what it is, its bytes)."""
        index = min(range(len(self.layers)), key=lambda i: self.layers[i].block_bytes)
        layer_bytes = self.layers[index].block_bytes
        if self.head_bytes <= layer_bytes:
            return "the output head", self.head_bytes
        return f"layer {index}'s dense block (attention, predictor, KV cache)", layer_bytes

    def as_dense_model(self) -> PlacementProblem:
        """The same model as llama.cpp runs it: every neuron computed, no predictors."""
        dense = tuple(
            dataclasses.replace(layer, freqs=np.ones_like(layer.freqs), predictor_bytes=0) for layer in self.layers
        )
        return dataclasses.replace(self, layers=dense)


@dataclass(frozen=True)
class Placement:
    gpu_neurons: tuple[int, ...]  # per layer: its gpu_neurons[l] most active FFN neurons are on the GPU
    dense_on_gpu: tuple[bool, ...]  # per layer: dense block and KV cache on the GPU
    head_on_gpu: bool

    def gpu_mask(self, problem: PlacementProblem, index: int) -> np.ndarray:
        """Boolean mask over layer ``index``'s neurons, in neuron-id order: True = on the GPU."""
        layer = problem.layers[index]
        mask = np.zeros(layer.n_neurons, dtype=bool)
        mask[layer.order[: self.gpu_neurons[index]]] = True
        return mask


@dataclass(frozen=True)
class LayerCost:
    """One layer's share of a token; every field is an array when built for an array of counts."""

    gpu_neurons: int
    dense_on_gpu: bool
    dense_s: float
    ffn_gpu_s: float
    ffn_cpu_s: float
    sync_s: float
    dense_vram: int
    predictor_vram: int
    kv_vram: int
    ffn_vram: int
    gpu_read_bytes: float  # expected bytes read from GPU memory
    read_bytes: float  # expected bytes read, both devices

    @classmethod
    def of(cls, problem: PlacementProblem, layer: Layer, gpu_neurons: int | np.ndarray, dense_on_gpu: bool) -> LayerCost:
        """The cost of putting the ``gpu_neurons`` most active neurons (one count or an array
        of them) on the GPU, with the dense block there or not."""
        k = np.asarray(gpu_neurons)
        gpu_active = layer.cumulative_freqs[k] * layer.neuron_bytes
        all_active = layer.cumulative_freqs[-1] * layer.neuron_bytes
        works_on_gpu = dense_on_gpu | (k > 0)
        works_on_cpu = (not dense_on_gpu) | (k < layer.n_neurons)
        device_seconds = problem.gpu_seconds if dense_on_gpu else problem.cpu_seconds
        return cls(
            gpu_neurons=gpu_neurons,
            dense_on_gpu=dense_on_gpu,
            dense_s=device_seconds(layer.dense_read_bytes),
            ffn_gpu_s=problem.gpu_seconds(gpu_active),
            ffn_cpu_s=problem.cpu_seconds(all_active - gpu_active),
            sync_s=np.where(works_on_gpu & works_on_cpu, problem.sync_seconds, 0.0),
            dense_vram=layer.dense_bytes if dense_on_gpu else 0,
            predictor_vram=layer.predictor_bytes if dense_on_gpu else 0,
            kv_vram=layer.kv_bytes if dense_on_gpu else 0,
            ffn_vram=k * layer.neuron_bytes,
            gpu_read_bytes=gpu_active + (layer.dense_read_bytes if dense_on_gpu else 0.0),
            read_bytes=all_active + layer.dense_read_bytes,
        )

    @property
    def total_s(self) -> float:
        return self.dense_s + np.maximum(self.ffn_gpu_s, self.ffn_cpu_s) + self.sync_s

    @property
    def vram(self) -> int:
        return self.dense_vram + self.predictor_vram + self.kv_vram + self.ffn_vram


@dataclass(frozen=True)
class HeadCost:
    on_gpu: bool
    total_s: float
    vram: int
    gpu_read_bytes: float
    read_bytes: float

    @classmethod
    def of(cls, problem: PlacementProblem, on_gpu: bool) -> HeadCost:
        nbytes = problem.head_bytes
        return cls(
            on_gpu=on_gpu,
            total_s=problem.gpu_seconds(nbytes) if on_gpu else problem.cpu_seconds(nbytes),
            vram=nbytes if on_gpu else 0,
            gpu_read_bytes=nbytes if on_gpu else 0,
            read_bytes=nbytes,
        )


@dataclass(frozen=True)
class Prediction:
    layers: tuple[LayerCost, ...]
    head: HeadCost
    reserve_vram: int

    @property
    def token_s(self) -> float:
        return float(sum(layer.total_s for layer in self.layers) + self.head.total_s)

    @property
    def vram(self) -> int:
        return int(self.reserve_vram + self.head.vram + sum(layer.vram for layer in self.layers))

    @property
    def gpu_read_bytes(self) -> float:
        return float(sum(layer.gpu_read_bytes for layer in self.layers) + self.head.gpu_read_bytes)

    @property
    def read_bytes(self) -> float:
        return float(sum(layer.read_bytes for layer in self.layers) + self.head.read_bytes)


def predict(problem: PlacementProblem, placement: Placement) -> Prediction:
    """Per-token time and GPU memory of ``placement`` under the cost and memory models above."""
    return Prediction(
        layers=tuple(
            LayerCost.of(problem, layer, k, dense_on_gpu)
            for layer, k, dense_on_gpu in zip(problem.layers, placement.gpu_neurons, placement.dense_on_gpu)
        ),
        head=HeadCost.of(problem, placement.head_on_gpu),
        reserve_vram=problem.reserve_bytes,
    )


def kv_cache_bytes_per_token(kv_dim: int, bytes_per_value: int = 2) -> int:
    """K and V of one token in one layer; ``kv_dim`` = KV heads x head size; f16 by default."""
    return 2 * kv_dim * bytes_per_value


def _per_layer(value: int | Sequence[int] | np.ndarray, n_layers: int, name: str) -> list[int]:
    values = np.broadcast_to(np.asarray(value), (n_layers,)) if np.ndim(value) == 0 else np.asarray(value)
    if values.shape != (n_layers,) or (values < 0).any():
        raise PitoolsError(f"{name}: expected one non-negative size or one per layer ({n_layers}), got {value!r}")
    return [int(v) for v in values]


def _derived_min_gpu_neurons(freqs: np.ndarray, neuron_bytes: int, problem: PlacementProblem) -> int:
    """PowerInfer's communication constraint: the fewest hot neurons whose move to the GPU
    saves at least one hand-off, i.e. below which splitting the layer does not pay."""
    saved_per_firing = problem.cpu_seconds(neuron_bytes) - problem.gpu_seconds(neuron_bytes)
    if saved_per_firing <= 0:
        return len(freqs)
    needed_firings = problem.sync_seconds / saved_per_firing
    # cumsum[i] covers the i + 1 most active neurons
    return int(min(np.searchsorted(np.cumsum(freqs), needed_firings) + 1, len(freqs)))


def problem_from_stats(
    freqs: Sequence[np.ndarray] | np.ndarray,
    neuron_bytes: int | Sequence[int],
    dense_bytes: int | Sequence[int],
    predictor_bytes: int | Sequence[int],
    kv_bytes_per_token: int | Sequence[int],
    head_bytes: int,
    hidden_bytes: int,
    *,
    n_ctx: int,
    budget_bytes: int,
    hardware: HardwareProfile,
    reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    min_gpu_share: float | None = None,
) -> PlacementProblem:
    """Build a problem from per-layer numbers (sizes in bytes, per layer or one for all).

    ``freqs[l][i]``: probability that neuron ``i`` of layer ``l`` fires on a token (from
    profiling). ``min_gpu_share``: the least fraction of a split layer's neurons on the GPU;
    None derives it from the hardware (see ``_derived_min_gpu_neurons``).
    """
    freqs = [np.asarray(f, dtype=np.float64) for f in freqs]
    n_layers = len(freqs)
    if n_layers == 0:
        raise PitoolsError("freqs: no layers")
    for index, f in enumerate(freqs):
        if f.ndim != 1 or not len(f) or not np.all((f >= 0) & (f <= 1)):
            raise PitoolsError(f"freqs of layer {index}: expected firing probabilities in [0, 1]")
    neuron_bytes = _per_layer(neuron_bytes, n_layers, "neuron_bytes")
    dense_bytes = _per_layer(dense_bytes, n_layers, "dense_bytes")
    predictor_bytes = _per_layer(predictor_bytes, n_layers, "predictor_bytes")
    kv_per_token = _per_layer(kv_bytes_per_token, n_layers, "kv_bytes_per_token")
    # The problem without its layers already knows the hardware's rates, which the layers' minimum
    # shares depend on.
    shell = PlacementProblem(
        layers=(),
        head_bytes=int(head_bytes),
        hidden_bytes=int(hidden_bytes),
        budget_bytes=int(budget_bytes),
        hardware=hardware,
        n_ctx=int(n_ctx),
        reserve_bytes=int(reserve_bytes),
    )
    layers = []
    for f, nb, db, pb, kv in zip(freqs, neuron_bytes, dense_bytes, predictor_bytes, kv_per_token):
        order = np.argsort(-f, kind="stable")
        if min_gpu_share is None:
            min_neurons = _derived_min_gpu_neurons(f[order], nb, shell)
        else:
            min_neurons = int(np.ceil(min_gpu_share * len(f)))
        layers.append(Layer(f[order], order, nb, db, pb, n_ctx * kv, min_neurons))
    return dataclasses.replace(shell, layers=tuple(layers))
