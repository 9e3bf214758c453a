"""Hardware profiles for the placement cost model: presets, JSON/TOML files, and a probe.

Decoding one token is memory-bound: each weight that is used is read once, so the time
of a piece of work is the bytes it reads divided by the bandwidth of the memory holding
them. A profile therefore needs only bandwidths plus the fixed cost of handing a layer's
activations between the two devices; for weights left on disk, the disk's bandwidth and
the latency and rate of small reads (``disk_probe.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from powerinfer_tools.solver.disk_probe import measure_disk

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.fileio import atomic_output
from powerinfer_tools.units import format_size


@dataclass(frozen=True)
class HardwareProfile:
    """Bandwidths in GB/s (10^9 bytes per second) and the per-layer hand-off latency."""

    name: str
    gpu_bandwidth_gbs: float  # GPU memory read bandwidth
    cpu_bandwidth_gbs: float  # host memory read bandwidth, all cores together
    pcie_bandwidth_gbs: float  # host <-> GPU copies of activations
    sync_latency_us: float  # per split layer: kernel launches, stream sync, small copies
    source: str = ""  # where the figures come from
    # The disk the model is read from (`pitools probe --disk`; solver/disk_probe.py); None: not measured.
    disk_read_gbs: float | None = None  # sequential, direct I/O
    disk_latency_us: float | None = None  # one small random read at queue depth 1
    disk_iops: float | None = None  # small random reads per second, several in flight

    def __post_init__(self) -> None:
        for name in ("gpu_bandwidth_gbs", "cpu_bandwidth_gbs", "pcie_bandwidth_gbs"):
            if not getattr(self, name) > 0:
                raise PitoolsError(f"hardware profile {self.name!r}: {name} must be positive")
        for name in ("disk_read_gbs", "disk_latency_us", "disk_iops"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise PitoolsError(f"hardware profile {self.name!r}: {name} must be positive")
        if not self.sync_latency_us >= 0:
            raise PitoolsError(f"hardware profile {self.name!r}: sync_latency_us must be >= 0")


# GPU bandwidths are spec-sheet peaks, which real kernels reach to roughly 70-90%. The desktop
# presets' host figures are those of the machines the PowerInfer paper measured on (PC-High and
# PC-Low: configured DRAM bandwidth, not the CPU's maximum). PCIe figures are per direction,
# the papers quote both directions together.
_SYNC_ESTIMATE = "sync latency is an estimate (two kernel launches, a stream sync, two small copies)"
PRESETS: dict[str, HardwareProfile] = {
    "rtx4090": HardwareProfile(
        "rtx4090", gpu_bandwidth_gbs=1008.0, cpu_bandwidth_gbs=67.2, pcie_bandwidth_gbs=31.5, sync_latency_us=20.0,
        source="NVIDIA RTX 4090 spec (384-bit GDDR6X at 21 Gbps); host of the PowerInfer paper's PC-High "
        f"(i9-13900K, 67.2 GB/s DRAM); PCIe 4.0 x16; {_SYNC_ESTIMATE}",
    ),
    "rtx2080ti": HardwareProfile(
        "rtx2080ti", gpu_bandwidth_gbs=616.0, cpu_bandwidth_gbs=38.4, pcie_bandwidth_gbs=15.75, sync_latency_us=20.0,
        source="NVIDIA RTX 2080 Ti spec (352-bit GDDR6 at 14 Gbps); host of the PowerInfer paper's PC-Low "
        f"(i7-12700K, 38.4 GB/s DRAM); PCIe 3.0 x16; {_SYNC_ESTIMATE}",
    ),
    "h200": HardwareProfile(
        "h200", gpu_bandwidth_gbs=4800.0, cpu_bandwidth_gbs=307.2, pcie_bandwidth_gbs=63.0, sync_latency_us=20.0,
        source="NVIDIA H200 SXM spec (HBM3e); one Xeon Platinum 8480+ socket (8 channels of DDR5-4800) "
        f"as in HGX H200 hosts; PCIe 5.0 x16; {_SYNC_ESTIMATE}",
    ),
}
DEFAULT_PRESET = "rtx4090"


def load_profile(spec: str) -> HardwareProfile:
    """A preset name (``rtx4090``) or the path of a ``.json`` or ``.toml`` profile."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if not path.is_file():
        raise PitoolsError(f"--hardware {spec}: neither a preset ({', '.join(PRESETS)}) nor a profile file")
    try:
        if path.suffix == ".json":
            data = json.loads(path.read_text())
        else:
            data = tomllib.loads(path.read_text())
    except (ValueError, OSError) as exc:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        raise PitoolsError(f"{path}: cannot read hardware profile: {exc}") from exc
    return _profile_from_dict(data, path)


def _profile_from_dict(data: object, path: Path) -> HardwareProfile:
    fields = {f.name: f for f in dataclasses.fields(HardwareProfile)}
    if not isinstance(data, dict):
        raise PitoolsError(f"{path}: a hardware profile is a table of keys {', '.join(fields)}")
    unknown = set(data) - set(fields)
    missing = {name for name, f in fields.items() if f.default is dataclasses.MISSING} - set(data)
    if unknown or missing:
        wrong = [f"unknown key {name}" for name in sorted(unknown)] + [f"no {name}" for name in sorted(missing)]
        raise PitoolsError(f"{path}: hardware profile has {', '.join(wrong)}; its keys are {', '.join(fields)}")
    for name, value in data.items():
        kind = fields[name].type  # a string ("float | None" for optional figures): postponed annotations
        expected = str if kind == "str" else (int, float)
        if not isinstance(value, expected) or isinstance(value, bool):
            raise PitoolsError(f"{path}: hardware profile key {name} must be a {kind}, not {value!r}")
    return HardwareProfile(**data)


def save_profile(profile: HardwareProfile, path: str | Path, overwrite: bool = True) -> None:
    """Write ``profile`` as JSON if ``path`` ends in ``.json``, else as TOML (figures not measured left out);
    a file there is replaced only with ``overwrite``."""
    data = {key: value for key, value in dataclasses.asdict(profile).items() if value is not None}
    if Path(path).suffix == ".json":
        text = json.dumps(data, indent=2) + "\n"
    else:
        # A flat table: JSON's string and number literals are valid TOML values.
        text = "".join(f"{key} = {json.dumps(value)}\n" for key, value in data.items())
    with atomic_output(path, overwrite=overwrite) as tmp:
        tmp.write_text(text)


def _median_bandwidth_gbs(nbytes: int, timed_pass: Callable[[], float], repeats: int) -> float:
    timed_pass()  # warm-up: page faults, library initialisation, clocks ramping up
    seconds = statistics.median(timed_pass() for _ in range(repeats))
    return nbytes / seconds / 1e9


def _weight_like_matrix_rows(nbytes: int, width: int = 4096) -> int:
    return max(1, nbytes // (4 * width))


def measure_cpu_bandwidth(nbytes: int = 2**30, repeats: int = 7) -> float:
    """Median GB/s of a float32 matrix-vector product streaming ``nbytes`` of host memory.

    A matrix-vector product is the FFN's own access pattern, and numpy hands it to a
    multithreaded BLAS, so all cores read, as in inference. ``nbytes`` must exceed the
    last-level cache or the figure measures the cache.
    """
    matrix = np.ones((_weight_like_matrix_rows(nbytes), 4096), dtype=np.float32)
    vector = np.ones(4096, dtype=np.float32)

    def timed_pass() -> float:
        start = time.perf_counter()
        matrix @ vector
        return time.perf_counter() - start

    return _median_bandwidth_gbs(matrix.nbytes, timed_pass, repeats)


def measure_gpu_bandwidth(nbytes: int = 2**30, repeats: int = 7) -> float | None:
    """The same measurement on the GPU through CuPy; None when CuPy or a device is missing."""
    try:
        import cupy
    except ImportError:
        return None
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return None
    except cupy.cuda.runtime.CUDARuntimeError:  # no driver, or no device visible
        return None
    matrix = cupy.ones((_weight_like_matrix_rows(nbytes), 4096), dtype=cupy.float32)
    vector = cupy.ones(4096, dtype=cupy.float32)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()

    def timed_pass() -> float:
        start.record()
        matrix @ vector
        end.record()
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) / 1e3

    return _median_bandwidth_gbs(matrix.nbytes, timed_pass, repeats)


# A pass over less takes tens of microseconds at memory speed, the order of the call and timer overhead,
# and fits in any CPU's caches: the figure would not be a bandwidth.
MIN_PROBE_BYTES = 4 * 2**20


def check_probe_size(nbytes: int) -> int:
    """``nbytes`` if a pass over that much measures memory bandwidth here; else PitoolsError naming --size."""
    if nbytes < MIN_PROBE_BYTES:
        raise PitoolsError(f"--size: {format_size(nbytes)} is too small to measure; give at least "
                           f"{format_size(MIN_PROBE_BYTES, round_up=True)}: a pass over less takes about as long as "
                           "timing it, and stays in the CPU caches")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if nbytes > memory:
        raise PitoolsError(f"--size: {format_size(nbytes)} is more than this machine's memory ({format_size(memory)})")
    return nbytes


def probe_profile(base: HardwareProfile, nbytes: int = 2**30, repeats: int = 7,
                  disk: Path | None = None) -> HardwareProfile:
    """Measure this machine, and the disk holding the file ``disk`` if given; figures that cannot be
    measured here are taken from ``base``."""
    check_probe_size(nbytes)
    disk_figures = measure_disk(disk) if disk is not None else None  # first: it fails fast on a bad path
    cpu = measure_cpu_bandwidth(nbytes, repeats)
    gpu = measure_gpu_bandwidth(nbytes, repeats)
    measured = "CPU bandwidth" + (" and GPU bandwidth" if gpu else "")
    profile = dataclasses.replace(
        base,
        name=f"probe of {platform.node() or 'this machine'}",
        cpu_bandwidth_gbs=round(cpu, 2),
        gpu_bandwidth_gbs=round(gpu, 2) if gpu else base.gpu_bandwidth_gbs,
        source=f"measured {measured} (float32 matrix-vector product over {nbytes / 2**20:.0f} MiB, "
        f"median of {repeats}); other figures from preset {base.name}",
    )
    if disk_figures is None:
        return profile
    return dataclasses.replace(profile, disk_read_gbs=disk_figures.read_gbs, disk_latency_us=disk_figures.latency_us,
                               disk_iops=disk_figures.iops, source=f"{profile.source}; {disk_figures.describe()} on {disk}")
