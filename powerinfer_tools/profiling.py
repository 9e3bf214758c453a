"""Activation profiling: which FFN neurons fire, how often, on a calibration corpus.

The reference engine runs over the corpus in windows of ``seq_len`` tokens; an
FFN hook counts, per layer and neuron, the tokens it fired on (non-zero
activated value) and sums its absolute activated value. A subsample of
(predictor input, fired mask) pairs is kept on disk, memory-mapped, for
training the predictors. Everything lives in one folder (layout in ``formats/README.md``)
and is checkpointed every ``checkpoint_seconds``, so an interrupted run resumes
at the last checkpoint.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file
from tqdm import tqdm

from .errors import PitoolsError
from .fileio import atomic_output, read_json, write_json
from .models import DecoderModel
from .models.layers import FFNTrace

FORMAT = "pitools-profile"
VERSION = 1
PROFILE_JSON = "profile.json"
STATS_FILE = "stats.safetensors"
PAIRS_DIR = "pairs"
REPORT_JSON = "report.json"
PLOT_FILE = "firing_cdf.png"
PAIR_X_DTYPE = np.float16
FP16_MAX = float(np.finfo(np.float16).max)
# The share of all firings whose carrying neurons PowerInfer's paper counts (its "hot" neurons).
HOT_SHARE = 0.8
# Layers drawn in the plot when there are too many for one curve each.
MAX_PLOTTED_LAYERS = 8


@dataclass(frozen=True)
class ProfileSettings:
    seq_len: int  # tokens per forward pass, each window with a fresh KV cache
    pairs_mib: int = 1024  # disk cap for the predictor training pairs, all layers together
    seed: int = 0  # which tokens' pairs are kept when the cap is smaller than the corpus
    checkpoint_seconds: float = 30.0  # not part of a run's identity: changing it does not block a resume


@dataclass
class FiringStats:
    """Per layer and neuron: tokens fired on, and the sum of absolute activated values."""

    fire_count: np.ndarray  # [n_layers, d_ff] int64
    abs_sum: np.ndarray  # [n_layers, d_ff] float64
    tokens: int = 0

    @classmethod
    def zeros(cls, n_layers: int, d_ff: int) -> FiringStats:
        return cls(np.zeros((n_layers, d_ff), np.int64), np.zeros((n_layers, d_ff), np.float64))

    @property
    def n_layers(self) -> int:
        return self.fire_count.shape[0]

    def save(self, path: Path, metadata: dict[str, str]) -> None:
        tensors = {"tokens": np.array(self.tokens, dtype=np.int64)}
        for i in range(self.n_layers):
            tensors[f"blk.{i}.fire_count"] = self.fire_count[i]
            tensors[f"blk.{i}.abs_sum"] = self.abs_sum[i]
        with atomic_output(path) as tmp:
            save_file(tensors, str(tmp), metadata=metadata)

    @classmethod
    def load(cls, path: Path) -> tuple[FiringStats, dict[str, str]]:
        try:
            with safe_open(str(path), "np") as f:
                metadata = f.metadata() or {}
                n_layers = sum(1 for name in f.keys() if name.endswith(".fire_count"))
                fire = np.stack([f.get_tensor(f"blk.{i}.fire_count") for i in range(n_layers)])
                abs_sum = np.stack([f.get_tensor(f"blk.{i}.abs_sum") for i in range(n_layers)])
                tokens = int(f.get_tensor("tokens"))
        except Exception as exc:  # noqa: BLE001 - safetensors raises several types for a bad file
            raise PitoolsError(f"{path}: not a readable profile stats file ({exc})") from None
        return cls(fire, abs_sum, tokens), metadata


class PairStore:
    """Predictor training pairs of every layer, as ``.npy`` files memory-mapped from ``folder``.

    ``blk.N.x.npy`` holds predictor inputs ``[capacity, d_model]`` (see
    ``predictor_input``) as float16, clipped to its range; ``blk.N.fired.npy`` the fired
    masks ``[capacity, ceil(d_ff/8)]``
    packed by ``np.packbits`` (first neuron in the high bit). Row ``r`` of every
    layer belongs to the same token.
    """

    def __init__(self, x: list[np.ndarray], fired: list[np.ndarray]):
        self.x, self.fired = x, fired

    @staticmethod
    def paths(folder: Path, layer: int) -> tuple[Path, Path]:
        return folder / f"blk.{layer}.x.npy", folder / f"blk.{layer}.fired.npy"

    @classmethod
    def create(cls, folder: Path, n_layers: int, d_model: int, d_ff: int, capacity: int) -> PairStore:
        folder.mkdir(parents=True, exist_ok=True)
        x, fired = [], []
        for i in range(n_layers):
            x_path, fired_path = cls.paths(folder, i)
            x.append(np.lib.format.open_memmap(x_path, "w+", PAIR_X_DTYPE, (capacity, d_model)))
            fired.append(np.lib.format.open_memmap(fired_path, "w+", np.uint8, (capacity, (d_ff + 7) // 8)))
        return cls(x, fired)

    @classmethod
    def open(cls, folder: Path, n_layers: int, mode: str = "r") -> PairStore:
        x, fired = [], []
        for i in range(n_layers):
            x_path, fired_path = cls.paths(folder, i)
            if not x_path.is_file() or not fired_path.is_file():
                raise PitoolsError(f"{folder}: training pairs of layer {i} are missing")
            x.append(np.lib.format.open_memmap(x_path, mode))
            fired.append(np.lib.format.open_memmap(fired_path, mode))
        return cls(x, fired)

    def write(self, layer: int, start: int, x: np.ndarray, fired: np.ndarray) -> None:
        self.x[layer][start : start + len(x)] = np.clip(x, -FP16_MAX, FP16_MAX)
        self.fired[layer][start : start + len(x)] = np.packbits(fired, axis=1)

    def flush(self) -> None:
        for a in self.x + self.fired:
            a.flush()


@dataclass(frozen=True)
class PairSampler:
    """Which tokens of each window become training pairs: ``capacity`` of ``total`` tokens, spread evenly.

    Window ``w`` starting at token ``start`` keeps ``floor((start+n)·c/t) - floor(start·c/t)``
    of its ``n`` tokens, picked by a generator seeded with (seed, w). The choice
    depends only on the window, so a resumed run picks the same tokens, and its
    rows start at ``floor(start·c/t)``.
    """

    capacity: int
    total: int
    seed: int

    def first_row(self, start: int) -> int:
        return start * self.capacity // self.total

    def rows(self, window: int, start: int, n_tokens: int) -> np.ndarray:
        k = self.first_row(start + n_tokens) - self.first_row(start)
        rng = np.random.default_rng([self.seed, window])
        return np.sort(rng.choice(n_tokens, size=k, replace=False))


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


@dataclass
class _WindowRecorder:
    """FFN hook for one window: per-layer firing counts, absolute sums and the sampled pairs."""

    rows: np.ndarray
    fire_count: dict[int, np.ndarray] = field(default_factory=dict)
    abs_sum: dict[int, np.ndarray] = field(default_factory=dict)
    pairs: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def __call__(self, trace: FFNTrace) -> None:
        fired = trace.fired
        self.fire_count[trace.layer] = fired.sum(axis=0)
        self.abs_sum[trace.layer] = np.abs(trace.activated).sum(axis=0, dtype=np.float64)
        if len(self.rows):
            x = predictor_input(trace.residual[self.rows])
            self.pairs[trace.layer] = (x, fired[self.rows])


def windows_of(tokens: np.ndarray, seq_len: int) -> list[np.ndarray]:
    return [tokens[i : i + seq_len] for i in range(0, len(tokens), seq_len)]


def pair_capacity(n_tokens: int, n_layers: int, d_model: int, d_ff: int, pairs_mib: int) -> int:
    """Training pairs that fit the disk cap: every token's when they fit, else fewer."""
    bytes_per_token = n_layers * (d_model * np.dtype(PAIR_X_DTYPE).itemsize + (d_ff + 7) // 8)
    return min(n_tokens, pairs_mib * 2**20 // bytes_per_token)


class Profiler:
    """Profiles ``model`` on ``tokens`` into ``folder``, resuming whatever run of the same identity is there."""

    def __init__(self, model: DecoderModel, model_name: str, tokens: np.ndarray, corpus: list[str],
                 folder: Path, settings: ProfileSettings):
        spec = model.spec
        if not spec.ffn.sparse:
            raise PitoolsError(
                f"{model_name}: its FFN is {spec.ffn.value}, which is dense (every neuron fires on every token); "
                "profiling needs a ReLU-family model (ReGLU, dReLU or ReLU)"
            )
        self.model, self.model_name, self.folder, self.settings = model, model_name, Path(folder), settings
        self.windows = windows_of(tokens, settings.seq_len)
        capacity = pair_capacity(len(tokens), spec.n_layers, spec.d_model, spec.d_ff, settings.pairs_mib)
        self.sampler = PairSampler(capacity, len(tokens), settings.seed)
        self.identity = {
            "format": FORMAT,
            "version": VERSION,
            "architecture": spec.architecture,
            "ffn": spec.ffn.value,
            "n_layers": spec.n_layers,
            "d_model": spec.d_model,
            "d_ff": spec.d_ff,
            "corpus": corpus,
            "corpus_sha256": hashlib.sha256(np.ascontiguousarray(tokens, dtype="<i4").tobytes()).hexdigest(),
            "tokens": len(tokens),
            "seq_len": settings.seq_len,
            "pairs_capacity": capacity,
            "seed": settings.seed,
        }

    def run(self, force: bool = False, progress: bool = True) -> FiringStats:
        stats, done = self._start_or_resume(force)
        n_layers = self.model.spec.n_layers
        pairs = PairStore.open(self.folder / PAIRS_DIR, n_layers, "r+") if self.sampler.capacity else None
        starts = np.cumsum([0] + [len(w) for w in self.windows])
        last_checkpoint = time.monotonic()
        bar = tqdm(total=int(starts[-1]), initial=int(starts[done]), unit="tok", desc="profile",
                   file=sys.stderr, disable=not progress, dynamic_ncols=True)
        with bar:
            for w in range(done, len(self.windows)):
                self._profile_window(w, int(starts[w]), stats, pairs)
                bar.update(len(self.windows[w]))
                if w + 1 == len(self.windows) or time.monotonic() - last_checkpoint >= self.settings.checkpoint_seconds:
                    self._checkpoint(stats, pairs, w + 1)
                    last_checkpoint = time.monotonic()
        return stats

    def _profile_window(self, w: int, start: int, stats: FiringStats, pairs: PairStore | None) -> None:
        window = self.windows[w]
        recorder = _WindowRecorder(self.sampler.rows(w, start, len(window)))
        self.model.ffn_hook = recorder
        try:
            self.model.forward(window, self.model.new_cache())
        finally:
            self.model.ffn_hook = None
        # Totals change only once the whole window is through, so a checkpoint never holds half a window.
        row = self.sampler.first_row(start)
        for layer in range(stats.n_layers):
            stats.fire_count[layer] += recorder.fire_count[layer]
            stats.abs_sum[layer] += recorder.abs_sum[layer]
            if layer in recorder.pairs:
                pairs.write(layer, row, *recorder.pairs[layer])
        stats.tokens += len(window)

    def _start_or_resume(self, force: bool) -> tuple[FiringStats, int]:
        spec = self.model.spec
        meta_path = self.folder / PROFILE_JSON
        if meta_path.is_file() and not force:
            previous = read_profile_json(self.folder)
            changed = [k for k, v in self.identity.items() if previous.get(k) != v]
            if changed:
                what = ", ".join(f"{k}: {previous.get(k)!r} there, {self.identity[k]!r} now" for k in changed
                                 if k != "corpus_sha256") or "the corpus text differs"
                raise PitoolsError(
                    f"{self.folder} holds a profile with other settings ({what}); "
                    "use another output folder, or --force to start over"
                )
            if (self.folder / STATS_FILE).is_file():
                stats, metadata = FiringStats.load(self.folder / STATS_FILE)
                return stats, int(metadata["windows_done"])
        # Fresh start: the identity is written first, so a run interrupted before
        # its first checkpoint is still recognised (and restarted) next time.
        for name in (STATS_FILE, REPORT_JSON, PLOT_FILE):
            (self.folder / name).unlink(missing_ok=True)
        shutil.rmtree(self.folder / PAIRS_DIR, ignore_errors=True)
        self._write_profile_json(windows_done=0, tokens_done=0)
        if self.sampler.capacity:
            PairStore.create(self.folder / PAIRS_DIR, spec.n_layers, spec.d_model, spec.d_ff,
                             self.sampler.capacity).flush()
        return FiringStats.zeros(spec.n_layers, spec.d_ff), 0

    def _checkpoint(self, stats: FiringStats, pairs: PairStore | None, windows_done: int) -> None:
        # Order matters: pairs reach the disk before the stats that count them;
        # the stats file (atomically replaced) is what a resume trusts.
        if pairs is not None:
            pairs.flush()
        stats.save(self.folder / STATS_FILE, {"format": FORMAT, "windows_done": str(windows_done)})
        self._write_profile_json(windows_done, stats.tokens)

    def _write_profile_json(self, windows_done: int, tokens_done: int) -> None:
        pairs_done = self.sampler.first_row(tokens_done)
        content = {
            "model": self.model_name,
            **self.identity,
            "progress": {
                "windows_done": windows_done,
                "windows": len(self.windows),
                "tokens_done": tokens_done,
                "pairs": pairs_done,
                "complete": windows_done == len(self.windows),
            },
        }
        write_json(self.folder / PROFILE_JSON, content)


def read_profile_json(folder: Path) -> dict:
    path = Path(folder) / PROFILE_JSON
    if not path.is_file():
        raise PitoolsError(f"{folder}: no {PROFILE_JSON}; is this a folder written by `pitools profile`?")
    content = read_json(path)
    if content.get("format") != FORMAT:
        raise PitoolsError(f"{path}: not a pitools profile (format {content.get('format')!r})")
    return content


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
    stats, _ = FiringStats.load(folder / STATS_FILE)
    return meta, stats


# --- report -----------------------------------------------------------------------------------


def hot_fraction(fire_count: np.ndarray, share: float = HOT_SHARE) -> float:
    """The smallest fraction of neurons that together carry ``share`` of all firings."""
    counts = np.sort(np.asarray(fire_count).ravel())[::-1]
    total = counts.sum()
    if total == 0:
        return 0.0
    k = int(np.searchsorted(np.cumsum(counts), share * total, side="left")) + 1
    return k / counts.size


def cumulative_share(fire_count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fraction of neurons, share of firings they carry), neurons sorted hottest first, from (0, 0)."""
    counts = np.sort(np.asarray(fire_count).ravel())[::-1].astype(np.float64)
    share = np.concatenate([[0.0], np.cumsum(counts) / max(counts.sum(), 1.0)])
    return np.arange(counts.size + 1) / counts.size, share


def firing_report(stats: FiringStats) -> dict:
    """Per layer and over the whole model: firing density per token, hot-neuron fraction, never-fired fraction."""
    tokens = max(stats.tokens, 1)

    def summary(counts: np.ndarray) -> dict:
        return {
            "density": float(counts.sum() / (tokens * counts.size)),
            "hot80_fraction": hot_fraction(counts),
            "never_fired": float(np.mean(counts == 0)),
        }

    return {
        "tokens": stats.tokens,
        "n_layers": stats.n_layers,
        "d_ff": int(stats.fire_count.shape[1]),
        "layers": [{"layer": i, **summary(c)} for i, c in enumerate(stats.fire_count)],
        "model": summary(stats.fire_count),
    }


def format_firing_report(report: dict, title: str = "") -> str:
    lines = [title] if title else []
    lines.append(f"{report['tokens']} tokens, {report['n_layers']} layers of {report['d_ff']} neurons")
    lines.append("layer   fires/token   neurons carrying 80% of firings   never fired")

    def row(name: str, r: dict) -> str:
        return f"{name:>5}   {r['density']:10.1%}   {r['hot80_fraction']:31.1%}   {r['never_fired']:11.1%}"

    lines += [row(str(r["layer"]), r) for r in report["layers"]]
    lines.append(row("all", report["model"]))
    lines.append("(PowerInfer's paper: 26% of neurons carry 80% of firings in an OPT-30B layer, "
                 "43% in LLaMA(ReGLU)-70B)")
    return "\n".join(lines)


def plotted_layers(n_layers: int) -> list[int]:
    if n_layers <= MAX_PLOTTED_LAYERS:
        return list(range(n_layers))
    return sorted({int(round(x)) for x in np.linspace(0, n_layers - 1, MAX_PLOTTED_LAYERS)})


def plot_firing_cdf(stats: FiringStats, path: Path, title: str) -> bool:
    """Write the cumulative-share plot; False (and no file) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never open a window
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 5))
    for i in plotted_layers(stats.n_layers):
        ax.plot(*cumulative_share(stats.fire_count[i]), lw=1.2, label=f"layer {i}")
    ax.plot(*cumulative_share(stats.fire_count), "k--", lw=1.5, label="whole model")
    ax.axhline(HOT_SHARE, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("fraction of neurons (sorted by firing frequency, hottest first)")
    ax.set_ylabel("share of all firings")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.01)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    with atomic_output(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    return True


def write_report(folder: Path) -> tuple[dict, str]:
    """Write ``report.json`` and the plot beside the stats; return the report and its text form."""
    folder = Path(folder)
    meta, stats = load_profile(folder)
    report = firing_report(stats)
    report["model_name"] = meta.get("model")
    report["complete"] = meta["progress"]["complete"]
    title = f"profile of {meta.get('model')}"
    if not report["complete"]:
        title += f" (incomplete: {stats.tokens} of {meta['tokens']} tokens)"
    write_json(folder / REPORT_JSON, report)
    plotted = plot_firing_cdf(stats, folder / PLOT_FILE, title)
    text = format_firing_report(report, title)
    text += f"\nplot: {folder / PLOT_FILE}" if plotted else "\nplot: skipped (install matplotlib to draw it)"
    return report, text


def export_powerinfer_activations(stats: FiringStats, out: Path) -> list[Path]:
    """``activation_N.pt`` per layer, as PowerInfer's solver reads: a 1-D int64 tensor of firing counts.

    Needs torch, which is not a dependency of this package; the stats file itself
    is readable without it.
    """
    try:
        import torch
    except ImportError:
        raise PitoolsError("exporting PowerInfer's activation_N.pt files needs torch (pip install torch)") from None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, counts in enumerate(stats.fire_count):
        path = out / f"activation_{i}.pt"
        with atomic_output(path, suffix=".pt") as tmp:
            torch.save(torch.from_numpy(counts.copy()), tmp)
        paths.append(path)
    return paths
