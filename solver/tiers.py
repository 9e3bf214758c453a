"""Three tiers (``pitools solve --ram``): each FFN neuron on the GPU, resident in RAM, or on disk behind its
layer's neuron cache, under a RAM budget and, when there is a GPU, a VRAM budget.

A layer's neurons, hottest first: its ``gpu_neurons`` most active on the GPU (with its dense block, as
in ``problem.py``), the next ``ram_neurons`` resident in RAM, the rest on disk. Every layer with disk
neurons has a cache of the same number of slots (``cache_slots``, or fewer when it has fewer disk
neurons), as the runtime sizes them (``runtime/ram_budget.py``). Without a GPU there is no GPU tier.

Memory model, RAM. Everything the runtime keeps in host memory counts against the budget:

* ``ram_reserve`` (``--ram-reserve``; 0 by default: the budget is the model's data);
* the token embeddings only when the output matrix is the embedding matrix (tied; counted once, with the
  head): otherwise the runtime reads a token's row from the file when the token comes;
* the output head (output norm and matrix) when it runs on the CPU;
* per layer whose dense block is not on the GPU: attention weights, norms, predictor and KV cache;
* the rows of RAM-resident neurons, and each layer's cache slots (one neuron's rows a slot).

VRAM is counted as in ``problem.py``. Cost model: as in ``problem.py``, the CPU computes every firing
neuron not on the GPU, reading its rows from memory (resident, or in a cache slot). A disk neuron
that fires and misses (``cache_model.expected_misses``) is read first: its bundle (gate, up and down
rows, padded to the direct-I/O alignment) costs ``max(bundle / bandwidth, 1 / IOPS)``: the runtime
reads misses from a thread pool, several in flight, so the disk's rate at depth bounds it rather than
one read's latency; a layer with any miss also waits one read's latency at depth 1 (probability
``1 - exp(-misses)``). The CPU side of a layer is its FFN time plus its disk time; the GPU side runs
alongside: ``dense + max(GPU FFN, CPU FFN + disk) + sync``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
from powerinfer_tools.solver.cache_model import expected_misses
from powerinfer_tools.solver.hardware import HardwareProfile
from powerinfer_tools.solver.problem import HeadCost, Layer, LayerCost, Placement, PlacementProblem

from powerinfer_tools.direct_io import ALIGNMENT

# For a profile without disk figures: a slow SSD. A SATA link carries at most about 0.55 GB/s; the
# small-read figures are below what `pitools probe --disk` measured on an SSD (docs/lab/benchmarks.md).
DEFAULT_DISK = {"disk_read_gbs": 0.5, "disk_latency_us": 100.0, "disk_iops": 10_000.0}
MIN_CACHE_SLOTS = 16  # per layer with disk neurons: a cache smaller than this thrashes on every token
# What the RAM tier needs beyond ``problem.STATS_KEYS`` (``tiered_problem``'s arguments; optional in a
# ``--stats`` file, 0 and False when absent): the token embedding matrix's bytes, and whether the output
# head's matrix is that matrix (tied).
EMBEDDING_STATS_KEYS = ("embedding_bytes", "embedding_in_head")


def bundle_bytes(neuron_bytes: int) -> int:
    """What a miss reads: a neuron's rows, padded to the direct-I/O alignment (``formats/ffn_bundle.py``)."""
    return -(-int(neuron_bytes) // ALIGNMENT) * ALIGNMENT


@dataclass(frozen=True)
class DiskCosts:
    read_gbs: float  # sequential bandwidth
    latency_us: float  # one small read at depth 1
    iops: float  # small reads per second, several in flight
    defaulted: tuple[str, ...]  # the profile's fields that were missing, taken from DEFAULT_DISK

    @classmethod
    def of(cls, hardware: HardwareProfile) -> DiskCosts:
        figures = {name: getattr(hardware, name) for name in DEFAULT_DISK}
        missing = tuple(name for name, value in figures.items() if value is None)
        figures.update({name: DEFAULT_DISK[name] for name in missing})
        return cls(figures["disk_read_gbs"], figures["disk_latency_us"], figures["disk_iops"], missing)

    def miss_seconds(self, neuron_bytes: int) -> float:
        return max(bundle_bytes(neuron_bytes) / (self.read_gbs * 1e9), 1.0 / self.iops)


@dataclass(frozen=True)
class TieredProblem:
    base: PlacementProblem  # layers, head and hardware; its VRAM budget and reserve when has_gpu
    ram_budget: int
    has_gpu: bool
    disk: DiskCosts
    embedding_bytes: int = 0  # the token embedding matrix
    embedding_in_head: bool = False  # tied: the head's matrix is the embedding matrix
    ram_reserve: int = 0

    @property
    def layers(self) -> tuple[Layer, ...]:
        return self.base.layers

    def head_ram(self, on_gpu: bool) -> int:
        """The head's and the embeddings' bytes in RAM (a tied embedding stays when the head is on the GPU:
        the tokens are still looked up on the CPU)."""
        embeddings = self.embedding_bytes if self.embedding_in_head and on_gpu else 0
        return embeddings + (0 if on_gpu else self.base.head_bytes)

    def disk_seconds(self, layer: Layer, misses: np.ndarray | float) -> np.ndarray:
        """A layer's wait for its misses per token (one count or an array of them)."""
        misses = np.asarray(misses, dtype=np.float64)
        return misses * self.disk.miss_seconds(layer.neuron_bytes) - np.expm1(-misses) * self.disk.latency_us * 1e-6


def cache_ram(layer: Layer, starts: np.ndarray | int, slots: int) -> np.ndarray:
    """Bytes of a layer's cache when its neurons from ``starts`` on are on disk."""
    return np.minimum(slots, layer.n_neurons - np.asarray(starts)) * layer.neuron_bytes


@dataclass(frozen=True)
class TieredPlacement:
    gpu_neurons: tuple[int, ...]  # per layer: its most active neurons on the GPU ...
    ram_neurons: tuple[int, ...]  # ... then the next most active resident in RAM; the rest on disk
    dense_on_gpu: tuple[bool, ...]
    head_on_gpu: bool
    cache_slots: int  # per layer with disk neurons (at most its disk neurons)

    @property
    def gpu_placement(self) -> Placement:
        return Placement(self.gpu_neurons, self.dense_on_gpu, self.head_on_gpu)

    def ram_mask(self, problem: TieredProblem, index: int) -> np.ndarray:
        """Boolean mask over layer ``index``'s neurons, in neuron-id order: True = resident in RAM."""
        layer, first = problem.layers[index], self.gpu_neurons[index]
        mask = np.zeros(layer.n_neurons, dtype=bool)
        mask[layer.order[first : first + self.ram_neurons[index]]] = True
        return mask

    def cache_bytes(self, problem: TieredProblem) -> int:
        """``cache_slots`` slots in every layer (what the runtime divides among the layers)."""
        return self.cache_slots * sum(layer.neuron_bytes for layer in problem.layers)


@dataclass(frozen=True)
class TierLayerCost:
    base: LayerCost  # the GPU side, the dense block and VRAM, as in the two-tier model
    ram_neurons: int
    disk_neurons: int
    disk_fired: float  # expected firings of disk neurons per token
    disk_misses: float  # expected reads from disk per token
    disk_s: float
    disk_read_bytes: float
    dense_ram: int  # attention and norms, predictor (when the block is not on the GPU)
    kv_ram: int
    ffn_ram: int  # RAM-resident neurons
    cache_ram: int

    @classmethod
    def of(cls, problem: TieredProblem, layer: Layer, gpu_neurons: int, ram_neurons: int, dense_on_gpu: bool,
           slots: int) -> TierLayerCost:
        start = gpu_neurons + ram_neurons
        misses = float(expected_misses(layer.freqs, [start], [slots])[0, 0])
        return cls(
            base=LayerCost.of(problem.base, layer, gpu_neurons, dense_on_gpu),
            ram_neurons=ram_neurons,
            disk_neurons=layer.n_neurons - start,
            disk_fired=float(layer.cumulative_freqs[-1] - layer.cumulative_freqs[start]),
            disk_misses=misses,
            disk_s=float(problem.disk_seconds(layer, misses)),
            disk_read_bytes=misses * bundle_bytes(layer.neuron_bytes),
            dense_ram=0 if dense_on_gpu else layer.dense_bytes + layer.predictor_bytes,
            kv_ram=0 if dense_on_gpu else layer.kv_bytes,
            ffn_ram=ram_neurons * layer.neuron_bytes,
            cache_ram=int(cache_ram(layer, start, slots)),
        )

    @property
    def ffn_cpu_s(self) -> float:
        """The CPU side of the FFN: computing the firing neurons not on the GPU, and waiting for the disk."""
        return float(self.base.ffn_cpu_s + self.disk_s)

    @property
    def total_s(self) -> float:
        return float(self.base.dense_s + max(self.base.ffn_gpu_s, self.ffn_cpu_s) + self.base.sync_s)

    @property
    def ram(self) -> int:
        return self.dense_ram + self.kv_ram + self.ffn_ram + self.cache_ram


@dataclass(frozen=True)
class TierPrediction:
    layers: tuple[TierLayerCost, ...]
    head: HeadCost
    reserve_vram: int  # 0 without a GPU
    head_ram: int  # output head on the CPU, and the token embeddings
    reserve_ram: int
    cache_slots: int

    @property
    def token_s(self) -> float:
        return float(sum(layer.total_s for layer in self.layers) + self.head.total_s)

    @property
    def vram(self) -> int:
        return int(self.reserve_vram + self.head.vram + sum(layer.base.vram for layer in self.layers))

    @property
    def ram(self) -> int:
        return int(self.reserve_ram + self.head_ram + sum(layer.ram for layer in self.layers))

    @property
    def disk_read_bytes(self) -> float:
        return float(sum(layer.disk_read_bytes for layer in self.layers))

    @property
    def cache_hit_rate(self) -> float | None:
        """Of the disk neurons' firings, the share found in the cache; None when none fire."""
        fired = sum(layer.disk_fired for layer in self.layers)
        return 1.0 - sum(layer.disk_misses for layer in self.layers) / fired if fired > 0 else None


def predict_tiers(problem: TieredProblem, placement: TieredPlacement) -> TierPrediction:
    """Per-token time, VRAM, RAM and disk reads of ``placement`` under the models above."""
    layers = tuple(
        TierLayerCost.of(problem, layer, g, r, dense, placement.cache_slots)
        for layer, g, r, dense in zip(problem.layers, placement.gpu_neurons, placement.ram_neurons,
                                      placement.dense_on_gpu)
    )
    return TierPrediction(
        layers=layers,
        head=HeadCost.of(problem.base, placement.head_on_gpu),
        reserve_vram=problem.base.reserve_bytes if problem.has_gpu else 0,
        head_ram=problem.head_ram(placement.head_on_gpu),
        reserve_ram=problem.ram_reserve,
        cache_slots=placement.cache_slots,
    )


def tiered_problem(base: PlacementProblem, ram_budget: int, *, has_gpu: bool, embedding_bytes: int = 0,
                   embedding_in_head: bool = False, ram_reserve: int = 0) -> TieredProblem:
    """The three-tier problem over ``base`` (``problem_from_stats``; its budget is ignored without a GPU),
    with the disk figures of its hardware profile (``DEFAULT_DISK`` for those it lacks)."""
    if not has_gpu:
        base = dataclasses.replace(base, budget_bytes=0, reserve_bytes=0)
    return TieredProblem(base, int(ram_budget), has_gpu, DiskCosts.of(base.hardware), int(embedding_bytes),
                         bool(embedding_in_head), int(ram_reserve))
