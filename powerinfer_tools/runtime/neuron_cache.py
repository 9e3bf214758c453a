"""PowerInfer-2's neuron cache: a layer's FFN rows held in memory, cold ones read from the file on demand.

With a RAM budget (``pitools run --ram``) a layer's neurons are *pinned* (the hottest, by the profile:
loaded once, never evicted) or *cold*: read from the model file only when the predictor selects them
and they are not already in one of the layer's cache *slots*. Pinned rows and slots share one set of
arrays per matrix (``rows``; pinned first), and ``row_of[n]`` is neuron n's row there or -1, so the
sparse kernels index them exactly as they index the memory-mapped file. Misses are read with direct
I/O (``direct_io``: the page cache would hold a second copy outside the budget), runs of neighbouring
neurons coalesced into one read, the reads issued from a thread pool so that several are in flight
(a disk serves small reads at depth several times faster than one at a time: `pitools probe --disk`),
each thread reading and copying rows into their slots in compiled code (``kernels.row_reads``).

Eviction (``POLICIES``): ``lru`` evicts the slot used longest ago (PowerInfer-2's choice); ``lfu``
the slot used least often since it was filled, ties to the older (the default, ``DEFAULT_POLICY``). Slots of the neurons being computed
are never evicted: a step needing more cold neurons than there are slots streams them through the cache
in order (``stream_in_order``), reading the next range while the current one is computed.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from powerinfer_tools.direct_io import DirectReader, aligned_buffer
from powerinfer_tools.errors import PitoolsError

POLICIES = ("lru", "lfu")
# The default: on the same token trace LFU read 2-6% fewer bytes from disk than LRU at every cache share
# tried (examples/cache_policies.py; docs/lab/benchmarks.md, "Under a memory limit").
DEFAULT_POLICY = "lfu"
# Reads in flight. Random 4 KiB direct reads through NeuronFile from an SSD came faster with more threads up to
# 8 and no faster (slower at 16) beyond.
READ_THREADS = 8
MAX_READ_BYTES = 256 << 10  # a coalesced read's span


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
    disk_bytes: int = 0

    def snapshot(self) -> CacheCounters:
        return dataclasses.replace(self)

    def since(self, before: CacheCounters) -> CacheCounters:
        """What was counted after ``before`` (a snapshot of these counters)."""
        return CacheCounters(self.hits - before.hits, self.misses - before.misses,
                             self.disk_bytes - before.disk_bytes)


class NeuronFile:
    """Direct reads of neurons' rows from one model file, shared by every layer's cache. One batch of
    reads is in flight at a time (a layer waits for its misses before the next layer loads)."""

    def __init__(self, path, threads: int = READ_THREADS):
        self.reader = DirectReader(path)
        self.threads = threads
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="neuron-read")
        self._buffer = np.frombuffer(aligned_buffer(MAX_READ_BYTES), dtype=np.uint8)
        # The file and threads go with the model: a process that loads many models keeps no descriptors.
        weakref.finalize(self, _release, self.pool, self.reader)

    def _staging(self, nbytes: int) -> np.ndarray:
        if nbytes > len(self._buffer):
            self._buffer = np.frombuffer(aligned_buffer(2 * nbytes), dtype=np.uint8)
        return self._buffer

    def read(self, neurons: np.ndarray, sources: list[RowSource], targets: list[np.ndarray],
             slots: np.ndarray) -> Callable[[], int]:
        """Start reading sorted ``neurons``' rows into ``targets[matrix][slots[i]]``; returns the wait, which
        returns the bytes read once every row is in place (and raises on a failed or short read)."""
        # numba's module, imported at the first read: a run that reads nothing from disk need not load numba
        from powerinfer_tools.kernels.row_reads import PREAD, plan_reads, read_rows

        plan = plan_reads(neurons, sources, slots, MAX_READ_BYTES)
        buffer = self._staging(plan.total)
        got = np.zeros(len(plan), dtype=np.int64)
        targets = tuple(targets)
        futures = [self.pool.submit(read_rows, PREAD, self.reader.fileno, buffer, plan.reads, plan.copies,
                                    plan.copy_start, targets, got, first, self.threads)
                   for first in range(min(self.threads, len(plan)))]

        def wait() -> int:
            for f in futures:
                f.result()
            short = np.flatnonzero(got < plan.reads[:, 3])
            if len(short):
                self._raise_for(plan.reads[short[0]], int(got[short[0]]))
            return plan.total

        return wait

    def _raise_for(self, read: np.ndarray, got: int) -> None:
        """The error for a read that failed (``got`` -1: read again here for the system's reason) or came
        back short."""
        offset, length, at, needed = (int(v) for v in read)
        if got < 0:
            self.reader.read_into(memoryview(self._buffer)[at : at + length], offset)
            raise PitoolsError(f"{self.reader.path}: a read of {length} bytes at {offset} failed")
        raise PitoolsError(f"{self.reader.path}: the file ends at byte {offset + got}, before the neuron rows it "
                           f"should hold (to byte {offset + needed}): truncated or changed while in use")


def _release(pool: ThreadPoolExecutor, reader: DirectReader) -> None:
    pool.shutdown(wait=True)
    reader.close()


class NeuronCache:
    """One layer's pinned neurons and cache slots: ``rows`` holds one uint8 array per matrix (gate, up,
    ``ffn_down_t``), ``len(pinned) + capacity`` rows each (``matrices`` views them in their stored type).
    Not thread-safe: one forward pass at a time."""

    def __init__(self, file: NeuronFile, sources: list[RowSource], row_bytes: list[int], d_ff: int,
                 pinned: np.ndarray, capacity: int, policy: str = DEFAULT_POLICY):
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
        for first in range(0, len(order), 4096):  # bounded staging: a layer's pinned rows can be large
            chunk = order[first : first + 4096]
            file.read(chunk, sources, self.rows, self.row_of[chunk])()

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

    def pinned(self, neurons: np.ndarray) -> np.ndarray:
        """Mask over ``neurons``: pinned (in memory for the whole run, outside the slots)."""
        rows = self.row_of[neurons]
        return (rows >= 0) & (rows < self.n_pinned)

    def keep(self, neurons: np.ndarray) -> None:
        """Protect the slots of resident ``neurons`` from eviction this step without counting a use (rows
        that a later part of the step computes)."""
        slots = self.row_of[neurons] - self.n_pinned
        self.last_use[slots[slots >= 0]] = self.clock

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
        wait = self.file.read(neurons, self.sources, self.rows, self.row_of[neurons])
        return lambda: self._count(wait())

    def _count(self, nbytes: int) -> None:
        self.counters.disk_bytes += nbytes

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
    """The sum of ``compute(selection)`` over consecutive selections of ``neurons`` (index ranges into it,
    from ``stream_in_order``) that together cover them all, each computed once its rows are in memory.
    The ranges fill the cache, read and computed in turn: ``compute`` is the general path's (a prompt's
    tokens, or dense mode), whose cost per call outweighs what overlapping it with the reads would save."""
    out = None
    for first, stop in stream_in_order(cache, neurons, overlap=False):
        out = _add(out, compute(np.arange(first, stop)))
    return out


def stream_in_order(cache: NeuronCache, neurons: np.ndarray, overlap: bool = True):
    """Consecutive ranges ``(first, stop)`` of ``neurons``, in order, whose rows are in memory when each is
    yielded, for one step. When the step's cold neurons fit in the cache it is one range. Otherwise, with
    ``overlap``, each range needs at most half the slots, and the next range's misses are read while the
    caller computes the current one, so that the disk always has work; without it (or with one slot) the
    ranges fill the cache and are read and computed in turn."""
    cache.new_step(neurons[cache.resident(neurons)])  # the hits, counted
    cache.new_step(neurons[:0])  # any slot may be refilled now; each range protects its own
    slotted = np.flatnonzero(~cache.pinned(neurons))  # pinned neurons never need a slot
    overlap = overlap and cache.capacity >= 2
    per_range = cache.capacity // 2 if overlap and len(slotted) > cache.capacity else max(cache.capacity, 1)
    bounds = [0, *slotted[per_range::per_range].tolist(), len(neurons)]
    wait = _start_range(cache, neurons[: bounds[1]])
    for first, stop, after in zip(bounds, bounds[1:], bounds[2:] + [None]):
        wait()
        if after is None:
            yield first, stop
            return
        cache.new_step(neurons[:0])
        if overlap:
            cache.keep(neurons[first:stop])  # computed while the next range is read
            wait = _start_range(cache, neurons[stop:after])
            yield first, stop
        else:
            yield first, stop
            wait = _start_range(cache, neurons[stop:after])


def _start_range(cache: NeuronCache, chosen: np.ndarray) -> Callable[[], None]:
    """Protect the cached of ``chosen`` and start reading the rest; the wait for them."""
    cache.keep(chosen)
    return cache.load(chosen[~cache.resident(chosen)])


def _add(total, part):
    return part if total is None else total + part
