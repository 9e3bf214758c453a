"""The profile folder (written by ``pitools profile``): its files, their readers and writers.

Layout (``formats/README.md``)::

    profile/
      profile.json          {"format": "pitools-profile", "version": 1, the run's identity, "progress": ...}
      stats.safetensors     tokens; blk.N.fire_count [d_ff] int64, blk.N.abs_sum [d_ff] float64
      pairs/blk.N.x.npy     predictor inputs [capacity, d_model] float16 (``predictor_input``)
      pairs/blk.N.fired.npy fired masks [capacity, ceil(d_ff/8)] uint8, packed bits
      report.json, firing_cdf.png   the firing report and its plot

A mixture of experts (profile.json ``"experts": E``) profiles each layer as one FFN of
``E * d_ff`` neurons, expert ``e``'s at ``e*d_ff .. (e+1)*d_ff - 1``: a neuron's count is of the
tokens routed to its expert, ``blk.N.routed [E]`` int64 counts those tokens, and each fired row
ends with ``E`` routing bits (the token went to expert ``e``).

Every reader checks what it opens: profile.json holds every field its readers use,
the stats and the training pairs have the profile's shape, and a corrupt or truncated
file is an error naming it (never zero-filled).
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np
from powerinfer_tools.formats.json_fields import check_fields, check_format
from powerinfer_tools.formats.model_spec import FFNUnit, ffn_units
from safetensors import safe_open
from safetensors.numpy import save_file

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.fileio import atomic_output, read_json, write_json

FORMAT = "pitools-profile"
VERSION = 1
PROFILE_JSON = "profile.json"
STATS_FILE = "stats.safetensors"
PAIRS_DIR = "pairs"
REPORT_JSON = "report.json"
PLOT_FILE = "firing_cdf.png"
PAIR_X_DTYPE = np.float16
FP16_MAX = float(np.finfo(np.float16).max)


def layer_neurons(d_ff: int, experts: int) -> int:
    """Neurons profiled per layer: its FFN's, or all its experts' side by side."""
    return d_ff * max(experts, 1)


def fired_bits(d_ff: int, experts: int) -> int:
    """Bits of one token's fired row in a layer's pairs: its neurons, then a mixture's routing bits."""
    return layer_neurons(d_ff, experts) + experts


@dataclass
class FiringStats:
    """Per layer and neuron: tokens fired on, and the sum of absolute activated values; for a mixture,
    per layer and expert the tokens routed to it (``routed``)."""

    fire_count: np.ndarray  # [n_layers, layer_neurons] int64
    abs_sum: np.ndarray  # [n_layers, layer_neurons] float64
    tokens: int = 0
    routed: np.ndarray | None = None  # [n_layers, experts] int64; None: no mixture

    @classmethod
    def zeros(cls, n_layers: int, d_ff: int, experts: int = 0) -> FiringStats:
        width = layer_neurons(d_ff, experts)
        routed = np.zeros((n_layers, experts), np.int64) if experts else None
        return cls(np.zeros((n_layers, width), np.int64), np.zeros((n_layers, width), np.float64), routed=routed)

    @property
    def n_layers(self) -> int:
        return self.fire_count.shape[0]

    def unit_frequencies(self, unit: FFNUnit, d_ff: int) -> np.ndarray:
        """A unit's firing probability per neuron: of every token, or of those routed to its expert."""
        if unit.expert is None:
            return self.fire_count[unit.layer] / max(self.tokens, 1)
        counts = self.fire_count[unit.layer, unit.expert * d_ff : (unit.expert + 1) * d_ff]
        return counts / max(int(self.routed[unit.layer, unit.expert]), 1)

    def unit_counts(self, unit: FFNUnit, d_ff: int) -> np.ndarray:
        """A unit's firing count per neuron."""
        start = 0 if unit.expert is None else unit.expert * d_ff
        return self.fire_count[unit.layer, start : start + d_ff]

    def save(self, path: Path, metadata: dict[str, str]) -> None:
        tensors = {"tokens": np.array(self.tokens, dtype=np.int64)}
        for i in range(self.n_layers):
            tensors[f"blk.{i}.fire_count"] = self.fire_count[i]
            tensors[f"blk.{i}.abs_sum"] = self.abs_sum[i]
            if self.routed is not None:
                tensors[f"blk.{i}.routed"] = self.routed[i]
        with atomic_output(path, overwrite=True) as tmp:
            save_file(tensors, str(tmp), metadata=metadata)

    @classmethod
    def load(cls, path: Path, n_layers: int, d_ff: int, experts: int = 0) -> tuple[FiringStats, dict[str, str]]:
        """The stats of ``n_layers`` layers of ``d_ff`` neurons (per expert), and the file's metadata."""
        try:
            with safe_open(str(path), "np") as f:
                metadata = f.metadata() or {}
                fire = np.stack([f.get_tensor(f"blk.{i}.fire_count") for i in range(n_layers)])
                abs_sum = np.stack([f.get_tensor(f"blk.{i}.abs_sum") for i in range(n_layers)])
                routed = np.stack([f.get_tensor(f"blk.{i}.routed") for i in range(n_layers)]) if experts else None
                tokens = int(f.get_tensor("tokens"))
        except Exception as exc:  # noqa: BLE001 - safetensors raises several types for a bad file
            raise PitoolsError(f"{path}: not a readable profile stats file ({exc!r})") from None
        width = layer_neurons(d_ff, experts)
        if fire.shape != (n_layers, width) or abs_sum.shape != (n_layers, width) or fire.dtype != np.int64:
            raise PitoolsError(f"{path}: holds firing counts {fire.dtype} {list(fire.shape)}; "
                               f"the profile has {n_layers} layers of {width} neurons")
        if routed is not None and routed.shape != (n_layers, experts):
            raise PitoolsError(f"{path}: holds routing counts {list(routed.shape)}; "
                               f"the profile has {n_layers} layers of {experts} experts")
        return cls(fire, abs_sum, tokens, routed), metadata


class PairStore:
    """Predictor training pairs of every layer: ``.npy`` files in ``folder``, read by memory map.

    ``blk.N.x.npy`` holds predictor inputs ``[capacity, d_model]`` (see
    ``predictor_input``) as float16, clipped to its range; ``blk.N.fired.npy`` the fired
    masks ``[capacity, ceil(bits/8)]`` (``fired_bits``)
    packed by ``np.packbits`` (first neuron in the high bit). Row ``r`` of every
    layer belongs to the same token.

    The files are written with ordinary file I/O, never through the map: their space is
    reserved when they are created, and a write that still fails (a full disk) is an
    OSError, where a store into a memory map would kill the process with SIGBUS.
    """

    def __init__(self, x: list[np.memmap], fired: list[np.memmap]):
        self.x, self.fired = x, fired

    @staticmethod
    def paths(folder: Path, layer: int) -> tuple[Path, Path]:
        return folder / f"blk.{layer}.x.npy", folder / f"blk.{layer}.fired.npy"

    @staticmethod
    def shapes(capacity: int, d_model: int, bits: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The shapes of one layer's x and fired files."""
        return (capacity, d_model), (capacity, (bits + 7) // 8)

    @classmethod
    def create(cls, folder: Path, n_layers: int, d_model: int, bits: int, capacity: int) -> PairStore:
        x_shape, fired_shape = cls.shapes(capacity, d_model, bits)
        with _writing(folder):
            folder.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(n_layers):
                x_path, fired_path = cls.paths(folder, i)
                _create_npy(x_path, PAIR_X_DTYPE, x_shape)
                _create_npy(fired_path, np.uint8, fired_shape)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)  # give back the space of a store that does not fit
            raise
        return cls.open(folder, n_layers, (capacity, d_model, bits))

    @classmethod
    def open(cls, folder: Path, n_layers: int, shape: tuple[int, int, int] | None = None) -> PairStore:
        """Map every layer's files, checked: readable headers, data complete, every layer alike
        and, given ``shape`` (capacity, d_model, fired bits: what profile.json says), of that shape."""
        x, fired = [], []
        for i in range(n_layers):
            x_path, fired_path = cls.paths(folder, i)
            if not x_path.is_file() or not fired_path.is_file():
                raise PitoolsError(f"{folder}: training pairs of layer {i} are missing")
            x.append(_map_npy(x_path, PAIR_X_DTYPE))
            fired.append(_map_npy(fired_path, np.uint8))
            x_shape, fired_shape = cls.shapes(*shape) if shape else (x[0].shape, fired[0].shape)
            for array, expected in ((x[i], x_shape), (fired[i], fired_shape)):
                if array.shape != expected:
                    raise PitoolsError(f"{array.filename}: holds {list(array.shape)} training pairs; "
                                       f"the profile needs {list(expected)}")
        return cls(x, fired)

    def write(self, layer: int, start: int, x: np.ndarray, fired: np.ndarray) -> None:
        _write_rows(self.x[layer], start, np.clip(x, -FP16_MAX, FP16_MAX))
        _write_rows(self.fired[layer], start, np.packbits(fired, axis=1))

    def flush(self) -> None:
        """Push everything written to the disk (what a checkpoint counts must be there)."""
        for a in self.x + self.fired:
            with _writing(a.filename), open(a.filename, "rb") as f:
                os.fsync(f.fileno())


@contextlib.contextmanager
def _writing(path: str | Path) -> Iterator[None]:
    """Turn a failed write (a full disk, a read-only folder) into one error naming the file."""
    try:
        yield
    except OSError as exc:
        raise PitoolsError(f"{path}: cannot write training pairs: {exc.strerror or exc}") from None


def _create_npy(path: Path, dtype, shape: tuple[int, ...]) -> None:
    """An .npy file of ``shape``, its data space reserved now: a disk too small fails here,
    before profiling starts, rather than hours into it."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape}
    with _writing(path), open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        f.flush()
        try:
            os.posix_fallocate(f.fileno(), f.tell(), nbytes)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            f.truncate(f.tell() + nbytes)  # a file system that cannot reserve: writes report a full disk


def _map_npy(path: Path, dtype) -> np.memmap:
    """A read-only map of an .npy file of ``dtype``; a corrupt header or a file shorter than its
    header says is an error naming it (numpy would extend it with zeros, or fail with a traceback)."""
    try:
        with open(path, "rb") as f:
            shape, offset = _npy_header(f, np.dtype(dtype))
        size = os.stat(path).st_size
    except OSError as exc:
        raise PitoolsError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except Exception as exc:  # noqa: BLE001 - numpy's header parser raises many types (and warns) on garbage
        raise PitoolsError(f"{path}: corrupt training-pair file ({' '.join(str(exc).split())})") from None
    needed = offset + math.prod(shape) * np.dtype(dtype).itemsize
    if size < needed:
        raise PitoolsError(f"{path}: truncated training-pair file ({size} bytes, its header says {needed})")
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


def _npy_header(f: BinaryIO, dtype: np.dtype) -> tuple[tuple[int, int], int]:
    """(shape, data offset) of an .npy file that must hold a C-order matrix of ``dtype`` with rows."""
    read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    version = np.lib.format.read_magic(f)
    if version not in read_header:
        raise ValueError(f"unsupported .npy version {version}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's warning on a header it had to repair: it is corrupt
        shape, fortran_order, found = read_header[version](f)
    if found != dtype or fortran_order or len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"holds {'Fortran' if fortran_order else 'C'}-order {found} {list(shape)}, "
                         f"not {dtype} training pairs")
    return shape, f.tell()


def _write_rows(array: np.memmap, start: int, rows: np.ndarray) -> None:
    """Rows ``start ..`` of a mapped .npy file, written through the file (the map then shows them)."""
    if start + len(rows) > len(array):
        raise IndexError(f"rows {start}..{start + len(rows)} of {array.filename} beyond its {len(array)}")
    with _writing(array.filename), open(array.filename, "r+b") as f:
        f.seek(array.offset + start * array.strides[0])
        f.write(np.ascontiguousarray(rows, dtype=array.dtype).data)


def predictor_input(residual: np.ndarray) -> np.ndarray:
    """What predictors are trained on: the residual stream entering the FFN block (before its norm,
    ``FFNTrace.residual``), scaled per token to unit RMS.

    PowerInfer's runtime feeds its predictors that residual (``ffn_inp``) unscaled. A predictor has
    no biases, so its output scales with its input and the decision ``output >= 0`` (the sparse
    threshold we write) is the same for any positive per-token factor; the scaling keeps training
    inputs of one size whatever the layer's residual norm, and fits them in float16.
    """
    rms = np.sqrt(np.mean(np.square(residual, dtype=np.float64), axis=-1, keepdims=True))
    return np.divide(residual, rms, out=np.zeros_like(residual), where=rms > 0).astype(residual.dtype)


def pair_bytes(n_layers: int, d_model: int, d_ff: int, experts: int = 0) -> int:
    """Disk bytes of one token's training pairs, all layers together."""
    return n_layers * (d_model * np.dtype(PAIR_X_DTYPE).itemsize + (fired_bits(d_ff, experts) + 7) // 8)


def pair_capacity(n_tokens: int, n_layers: int, d_model: int, d_ff: int, pairs_mib: int, experts: int = 0) -> int:
    """Training pairs that fit the disk cap: every token's when they fit, else fewer."""
    return min(n_tokens, pairs_mib * 2**20 // pair_bytes(n_layers, d_model, d_ff, experts))


# What readers of profile.json rely on: key -> (type, least value for numbers).
_PROFILE_FIELDS = {
    "architecture": (str, None),
    "ffn": (str, None),
    "corpus_sha256": (str, None),
    "n_layers": (int, 1),
    "d_model": (int, 1),
    "d_ff": (int, 1),
    "tokens": (int, 0),
    "pairs_capacity": (int, 0),
    "progress": (dict, None),
}
_PROGRESS_FIELDS = {"complete": (bool, None)}
_INCOMPLETE_FIELDS = {"tokens_done": (int, 0)}  # an incomplete profile's message says how far it got


def read_profile_json(folder: Path) -> dict:
    """A profile folder's ``profile.json``, checked to hold every field its readers use."""
    path = Path(folder) / PROFILE_JSON
    if not path.is_file():
        raise PitoolsError(f"{folder}: no {PROFILE_JSON}; is this a folder written by `pitools profile`?")
    content = read_json(path)
    check_format(path, content, FORMAT, "a pitools profile")
    check_fields(path, content, _PROFILE_FIELDS)
    if "experts" in content:  # written since mixtures were profiled; absent: none
        check_fields(path, content, {"experts": (int, 0)})
    check_fields(path, content["progress"], _PROGRESS_FIELDS, "progress.")
    if not content["progress"]["complete"]:
        check_fields(path, content["progress"], _INCOMPLETE_FIELDS, "progress.")
    return content


def write_profile_json(folder: Path, content: dict) -> None:
    write_json(Path(folder) / PROFILE_JSON, content)


def load_profile(folder: Path, require_complete: bool = False) -> tuple[dict, FiringStats]:
    """``profile.json`` and the stats of a profile folder."""
    folder = Path(folder)
    meta = read_profile_json(folder)
    if not (folder / STATS_FILE).is_file():
        raise PitoolsError(f"{folder}: no {STATS_FILE} yet; run `pitools profile` to (re)start the profile")
    if require_complete and not meta["progress"]["complete"]:
        p = meta["progress"]
        raise PitoolsError(
            f"{folder}: the profile is incomplete ({p['tokens_done']} of {meta['tokens']} tokens); "
            "run the same `pitools profile` command again to finish it"
        )
    stats, _ = FiringStats.load(folder / STATS_FILE, meta["n_layers"], meta["d_ff"], profile_experts(meta))
    return meta, stats


def profile_experts(meta: dict) -> int:
    """A profile's experts per layer (profile.json's ``experts``; 0, or absent, for no mixture)."""
    return meta.get("experts", 0)


def profile_units(meta: dict) -> list[FFNUnit]:
    """The FFNs a profile (or a predictor folder, whose meta has the same keys) covers, in order."""
    return ffn_units(meta["n_layers"], profile_experts(meta))
