"""PowerInfer-2's neuron cache: a layer's FFN rows held in memory, cold ones read from the file on demand.

With a RAM budget (``pitools run --ram``) a layer's neurons are *pinned* (the hottest, by the profile:
loaded once, never evicted) or *cold*: read from the model file only when the predictor selects them
and they are not already in one of the layer's cache *slots*. Pinned rows and slots share one set of
arrays per matrix (``rows``; pinned first), and ``row_of[n]`` is neuron n's row there or -1, so the
sparse kernels index them exactly as they index the memory-mapped file. Misses are read with direct
I/O (``direct_io``: the page cache would hold a second copy outside the budget), runs of neighbouring
neurons coalesced into one read, the reads issued from a thread pool so that several are in flight
(a disk serves small reads at depth several times faster than one at a time: `pitools probe --disk`).

Eviction (``POLICIES``): ``lru`` evicts the slot used longest ago (PowerInfer-2's choice); ``lfu``
the slot used least often since it was filled, ties to the older. Slots of the neurons being computed
are never evicted: a step needing more cold neurons than there are slots loads them in chunks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from powerinfer_tools.direct_io import ALIGNMENT, DirectReader, aligned_buffer
from powerinfer_tools.errors import PitoolsError

POLICIES = ("lru", "lfu")
READ_THREADS = 8  # reads in flight: the disk probe's depth-8 figure is ~4x its depth-1 rate here
MAX_READ_BYTES = 256 << 10  # a coalesced read's span (also each reading thread's buffer)


@dataclass(frozen=True)
class RowSource:
    """Where a matrix's rows lie in the file: row n at ``base + n * stride``; ``parts`` cut each read row
    into the matrices it feeds, ``(matrix index, offset in the row, bytes)``: three matrices from one
    bundle row, or one matrix per source in PowerInfer's layout."""

    base: int
    stride: int
    nbytes: int  # bytes of a row that are read
    parts: tuple[tuple[int, int, int], ...]


@dataclass
class CacheCounters:
    hits: int = 0
    misses: int = 0
    reads: int = 0  # read requests issued (coalesced runs)
    disk_bytes: int = 0


class NeuronFile:
    """Direct reads of neurons' rows from one model file, shared by every layer's cache."""

    def __init__(self, path, threads: int = READ_THREADS):
        self.reader = DirectReader(path)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="neuron-read")
        self._local = threading.local()

    def _buffer(self):
        if getattr(self._local, "buffer", None) is None:
            self._local.buffer = aligned_buffer(MAX_READ_BYTES + 2 * ALIGNMENT)
        return self._local.buffer

    def read_run(self, source: RowSource, neurons: np.ndarray, targets: list[np.ndarray], slots: np.ndarray) -> int:
        """Read the rows of sorted ``neurons`` (one span: ``read_runs``) of ``source`` into
        ``targets[matrix][slots[i]]``; the bytes read."""
        start = source.base + int(neurons[0]) * source.stride
        end = source.base + int(neurons[-1]) * source.stride + source.nbytes
        aligned = start // ALIGNMENT * ALIGNMENT
        length = -(-(end - aligned) // ALIGNMENT) * ALIGNMENT
        buffer = self._buffer()
        got = self.reader.read_into(memoryview(buffer)[:length], aligned)
        if got < end - aligned:
            raise PitoolsError(f"{self.reader.path}: the file ends at byte {aligned + got}, before the neuron rows "
                               f"it should hold (to byte {end}): truncated or changed while in use")
        raw = np.frombuffer(buffer, dtype=np.uint8, count=length)
        for neuron, slot in zip(neurons, slots):
            row = source.base + int(neuron) * source.stride - aligned
            for matrix, offset, nbytes in source.parts:
                targets[matrix][slot] = raw[row + offset : row + offset + nbytes]
        return length

    def read(self, neurons: np.ndarray, sources: list[RowSource], targets: list[np.ndarray],
             slots: np.ndarray) -> list[Future]:
        """Start reading sorted ``neurons``' rows into ``targets[matrix][slots[i]]``: one future per read."""
        futures = []
        for source in sources:
            for first, count in read_runs(neurons, source):
                futures.append(self.pool.submit(self.read_run, source, neurons[first : first + count], targets,
                                                slots[first : first + count]))
        return futures

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.reader.close()


def read_runs(neurons: np.ndarray, source: RowSource) -> list[tuple[int, int]]:
    """Sorted ``neurons`` as ``(index of the first, count)`` runs read together: rows whose aligned blocks
    touch or overlap (no whole block read in vain), up to ``MAX_READ_BYTES`` a run."""
    runs, start = [], 0
    for i in range(1, len(neurons) + 1):
        if i < len(neurons):
            previous_end = source.base + int(neurons[i - 1]) * source.stride + source.nbytes
            next_start = source.base + int(neurons[i]) * source.stride
            span = (int(neurons[i]) - int(neurons[start])) * source.stride + source.nbytes + 2 * ALIGNMENT
            if next_start // ALIGNMENT <= -(-previous_end // ALIGNMENT) and span <= MAX_READ_BYTES:
                continue
        runs.append((start, i - start))
        start = i
    return runs


def _wait(futures: list[Future], counters: CacheCounters) -> None:
    for f in futures:
        counters.disk_bytes += f.result()
        counters.reads += 1


class NeuronCache:
    """One layer's pinned neurons and cache slots: ``rows`` holds one uint8 array per matrix (gate, up,
    ``ffn_down_t``), ``len(pinned) + capacity`` rows each (``matrices`` views them in their stored type).
    Not thread-safe: one forward pass at a time."""

    def __init__(self, file: NeuronFile, sources: list[RowSource], row_bytes: list[int], d_ff: int,
                 pinned: np.ndarray, capacity: int, policy: str = "lru"):
        if policy not in POLICIES:
            raise PitoolsError(f"unknown cache policy {policy!r} (known: {', '.join(POLICIES)})")
        if capacity < 1 and len(pinned) < d_ff:
            raise PitoolsError("a neuron cache needs at least one slot per layer")
        self.file, self.sources, self.policy = file, sources, policy
        self.n_pinned, self.capacity = len(pinned), capacity
        self.rows = [np.zeros((len(pinned) + capacity, n), dtype=np.uint8) for n in row_bytes]
        self.row_of = np.full(d_ff, -1, dtype=np.int64)
        self.row_of[pinned] = np.arange(len(pinned))
        self.holder = np.full(capacity, -1, dtype=np.int64)  # the neuron in each slot
        self.last_use = np.full(capacity, -1, dtype=np.int64)  # the clock at a slot's last use (-1: empty)
        self.uses = np.zeros(capacity, dtype=np.int64)
        self.clock = 0
        self.counters = CacheCounters()
        order = np.sort(pinned)
        _wait(file.read(order, sources, self.rows, self.row_of[order]), CacheCounters())

    def resident(self, neurons: np.ndarray) -> np.ndarray:
        """Mask over ``neurons``: in memory now (pinned or cached)."""
        return self.row_of[neurons] >= 0

    def new_step(self, used: np.ndarray) -> None:
        """Start a step that uses the resident ``used``: cache hits, protected from eviction this step
        (pinned neurons are not the cache's business)."""
        self.clock += 1
        slots = self.row_of[used] - self.n_pinned
        slots = slots[slots >= 0]
        self.last_use[slots] = self.clock
        self.uses[slots] += 1
        self.counters.hits += len(slots)

    def free_slots(self) -> int:
        """Slots that a load may refill now: those not used this step."""
        return int(np.count_nonzero(self.last_use < self.clock))

    def load(self, neurons: np.ndarray) -> Callable[[], None]:
        """Start reading cold ``neurons`` (not resident; at most ``free_slots()``) into slots; returns the
        wait for them, which re-raises a failed read."""
        if len(neurons) == 0:
            return lambda: None
        neurons = np.sort(neurons)
        slots = self._victims(len(neurons))
        evicted = self.holder[slots]
        self.row_of[evicted[evicted >= 0]] = -1
        self.holder[slots] = neurons
        self.row_of[neurons] = self.n_pinned + slots
        self.last_use[slots], self.uses[slots] = self.clock, 1
        self.counters.misses += len(neurons)
        futures = self.file.read(neurons, self.sources, self.rows, self.row_of[neurons])
        return lambda: _wait(futures, self.counters)

    def _victims(self, n: int) -> np.ndarray:
        """The ``n`` slots to refill: empty ones first, then by the policy; never one used this step."""
        candidates = np.flatnonzero(self.last_use < self.clock)
        if n > len(candidates):
            raise RuntimeError(f"{n} neurons to load, {len(candidates)} slots free this step")
        if self.policy == "lru":
            key = self.last_use[candidates]
        else:  # fewest uses first, the older of equals first; empty slots (-1) before all
            key = np.where(self.last_use[candidates] < 0, -1,
                           self.uses[candidates] * (self.clock + 1) + self.last_use[candidates])
        return candidates[np.argpartition(key, n - 1)[:n]] if n < len(candidates) else candidates

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows)


def compute_cached(cache: NeuronCache, neurons: np.ndarray, compute: Callable[[np.ndarray], object]):
    """The sum of ``compute(selection)`` over selections of ``neurons`` (index arrays into it) that
    together cover them all, each computed once its rows are in memory. The resident ones are computed
    while the first misses are read; misses beyond the free slots are loaded and computed in chunks."""
    pending = np.flatnonzero(cache.resident(neurons))
    cache.new_step(neurons[pending])
    missing = np.flatnonzero(~cache.resident(neurons))
    out = compute(pending) if len(missing) == 0 else None
    while len(missing):
        free = cache.free_slots()
        take, missing = missing[:free], missing[free:]
        wait = cache.load(neurons[take])
        if len(pending):
            out = _add(out, compute(pending))
        wait()
        pending = take
        if len(missing):
            if len(pending):
                out = _add(out, compute(pending))
            pending = take[:0]
            cache.new_step(neurons[:0])  # what was computed may be evicted now
        elif len(pending):
            out = _add(out, compute(pending))
    return out


def _add(total, part):
    return part if total is None else total + part
