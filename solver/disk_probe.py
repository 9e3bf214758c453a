"""Measuring the disk a model is read from: what a cold neuron costs when it is not in memory.

Three figures, all with direct reads (``powerinfer_tools.direct_io``), so that the page cache does
not answer in the disk's place:

* ``read_gbs``: sequential bandwidth, 1 MiB requests in file order (loading whole tensors);
* ``latency_us``: the median time of one small random read at queue depth 1 (a neuron bundle, ~7 KB
  for LLaMA-7B at q4_0, read when it is needed and nothing else is in flight);
* ``iops``: small random reads per second with ``QUEUE_DEPTH`` in flight (a layer's predicted cold
  neurons read together from a thread pool, as PowerInfer-2 batches them). SSDs serve several
  requests at once, so this is well above ``1e6 / latency_us``.
"""

from __future__ import annotations

import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from powerinfer_tools.direct_io import ALIGNMENT, DirectReader, aligned_buffer
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.units import format_size

SEQUENTIAL_REQUEST = 2**20
SMALL_REQUEST = 8192  # a q4_0 7B neuron's gate, up and down rows, rounded up to the alignment
QUEUE_DEPTH = 8
MIN_DISK_PROBE_BYTES = 16 * 2**20  # fewer bytes give a sequential pass too short to time


@dataclass(frozen=True)
class DiskFigures:
    read_gbs: float
    latency_us: float
    iops: float
    direct: bool  # False: the filesystem refused O_DIRECT; cached pages were dropped before each pass

    def describe(self) -> str:
        how = "direct I/O" if self.direct else "buffered reads after dropping the file's cached pages (no O_DIRECT here)"
        return (f"disk {self.read_gbs:g} GB/s sequential, {self.latency_us:g} us per {SMALL_REQUEST // 1024} KiB "
                f"random read, {self.iops:g} such reads/s with {QUEUE_DEPTH} in flight ({how})")


def measure_disk(path: Path, max_bytes: int = 2**30, requests: int = 2000, seed: int = 0) -> DiskFigures:
    """Measure the disk holding ``path``, a file of at least ``MIN_DISK_PROBE_BYTES`` (a model file is
    the natural choice): one sequential pass over up to ``max_bytes`` of it, then ``requests`` random
    small reads one at a time and ``requests`` more ``QUEUE_DEPTH`` at a time."""
    check_disk_file(path)
    with DirectReader(path) as reader:
        span = min(reader.size, max_bytes) // ALIGNMENT * ALIGNMENT
        offsets = random.Random(seed).choices(range(0, span - SMALL_REQUEST + 1, ALIGNMENT), k=2 * requests)
        reader.forget_cached()
        read_gbs = span / _sequential_seconds(reader, span) / 1e9
        reader.forget_cached()
        latency = statistics.median(_timed_reads(reader, offsets[:requests]))
        reader.forget_cached()
        iops = requests / _parallel_seconds(reader, offsets[requests:])
        return DiskFigures(round(read_gbs, 3), round(latency * 1e6, 1), round(iops), reader.direct)


def check_disk_file(path: Path) -> None:
    """PitoolsError naming --disk unless ``path`` is a file large enough to measure a disk with."""
    if not path.is_file():
        raise PitoolsError(f"--disk {path}: not a file; give a large file on the disk to measure, e.g. the model")
    size = path.stat().st_size
    if size < MIN_DISK_PROBE_BYTES:
        raise PitoolsError(f"--disk {path}: {format_size(size)} is too small to measure a disk with; "
                           f"give a file of at least {format_size(MIN_DISK_PROBE_BYTES, round_up=True)}, "
                           "e.g. the model")


def _sequential_seconds(reader: DirectReader, span: int) -> float:
    buffer = aligned_buffer(SEQUENTIAL_REQUEST)
    start = time.perf_counter()
    for offset in range(0, span, SEQUENTIAL_REQUEST):
        reader.read_into(buffer, offset)
    return time.perf_counter() - start


def _timed_reads(reader: DirectReader, offsets: list[int]) -> list[float]:
    buffer = aligned_buffer(SMALL_REQUEST)
    seconds = []
    for offset in offsets:
        start = time.perf_counter()
        reader.read_into(buffer, offset)
        seconds.append(time.perf_counter() - start)
    return seconds


def _parallel_seconds(reader: DirectReader, offsets: list[int]) -> float:
    """Seconds for ``QUEUE_DEPTH`` threads to read ``offsets`` between them (``preadv`` releases the GIL)."""
    shares = [offsets[i::QUEUE_DEPTH] for i in range(QUEUE_DEPTH)]
    start = time.perf_counter()
    with ThreadPoolExecutor(QUEUE_DEPTH) as pool:
        list(pool.map(lambda share: _timed_reads(reader, share), shares))
    return time.perf_counter() - start
