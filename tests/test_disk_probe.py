"""Direct reads past the page cache (``powerinfer_tools/direct_io.py``) and `pitools probe --disk`."""

from __future__ import annotations

import dataclasses
import errno
import os

import numpy as np
import pytest
from cli_checks import fails, invoke
from powerinfer_tools.solver.disk_probe import MIN_DISK_PROBE_BYTES, measure_disk
from powerinfer_tools.solver.hardware import PRESETS, load_profile, save_profile

from powerinfer_tools.direct_io import ALIGNMENT, DirectReader, aligned_buffer
from powerinfer_tools.errors import PitoolsError


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("disk") / "weights.bin"
    data = np.random.default_rng(0).integers(0, 256, MIN_DISK_PROBE_BYTES + 1000, dtype=np.uint8)
    data.tofile(path)
    return path, data


def refuse_direct_io(monkeypatch):
    """Make every O_DIRECT open fail as on a filesystem without direct I/O (tmpfs)."""
    real_open = os.open

    def open_(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered fallback"])
def test_reads_return_the_files_bytes(data_file, monkeypatch, direct):
    path, data = data_file
    if not direct:
        refuse_direct_io(monkeypatch)
    with DirectReader(path) as reader:
        if direct and not reader.direct:
            pytest.skip("this filesystem has no direct I/O")
        assert reader.direct is direct and reader.size == len(data)
        buffer = aligned_buffer(3 * ALIGNMENT)
        reader.forget_cached()
        assert reader.read_into(buffer, 5 * ALIGNMENT) == 3 * ALIGNMENT
        assert bytes(buffer) == data[5 * ALIGNMENT : 8 * ALIGNMENT].tobytes()
        tail = len(data) // ALIGNMENT * ALIGNMENT
        assert reader.read_into(buffer, tail) == len(data) - tail  # short at the end of the file
        assert bytes(buffer[: len(data) - tail]) == data[tail:].tobytes()


def test_the_probe_measures_positive_figures_and_says_how(data_file, monkeypatch):
    path, _ = data_file
    figures = measure_disk(path, requests=50)
    assert figures.read_gbs > 0 and figures.latency_us > 0 and figures.iops > 0
    refuse_direct_io(monkeypatch)
    fallback = measure_disk(path, requests=50)
    assert not fallback.direct and "no O_DIRECT here" in fallback.describe()


def test_probe_disk_writes_the_figures_into_the_profile(data_file, tmp_path):
    path, _ = data_file
    out = tmp_path / "hw.toml"
    result = invoke("probe", "-o", out, "--size", "8MiB", "--repeats", "1", "--disk", path)
    assert result.exit_code == 0, result.output
    profile = load_profile(str(out))
    assert profile.disk_read_gbs > 0 and profile.disk_latency_us > 0 and profile.disk_iops > 0
    assert str(path) in profile.source
    without = tmp_path / "memory-only.toml"
    assert invoke("probe", "-o", without, "--size", "8MiB", "--repeats", "1").exit_code == 0
    assert "disk" not in without.read_text() and load_profile(str(without)).disk_read_gbs is None


def test_probe_disk_refuses_what_it_cannot_measure(tmp_path):
    small = tmp_path / "small.bin"
    small.write_bytes(b"x" * 100_000)
    out = tmp_path / "hw.toml"
    fails("probe", "-o", out, "--size", "8MiB", "--disk", small, match="too small to measure a disk", names=small)
    fails("probe", "-o", out, "--size", "8MiB", "--disk", tmp_path, match="not a file", names=tmp_path)
    fails("probe", "-o", out, "--size", "8MiB", "--disk", tmp_path / "missing", match="not a file")
    assert not out.exists()


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_disk_figures_round_trip_and_are_checked(tmp_path, suffix):
    profile = dataclasses.replace(PRESETS["rtx4090"], disk_read_gbs=0.95, disk_latency_us=81.0, disk_iops=12000)
    path = tmp_path / f"hw{suffix}"
    save_profile(profile, path)
    assert load_profile(str(path)) == profile
    path.write_text(path.read_text().replace("0.95", "-1"))
    with pytest.raises(PitoolsError, match="disk_read_gbs must be positive"):
        load_profile(str(path))
