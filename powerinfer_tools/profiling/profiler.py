"""Activation profiling: which FFN neurons fire, how often, on a calibration corpus.

The reference engine runs over the corpus in windows of ``seq_len`` tokens; an
FFN hook counts, per layer and neuron, the tokens it fired on (non-zero
activated value) and sums its absolute activated value. A subsample of
(predictor input, fired mask) pairs is kept on disk, memory-mapped, for
training the predictors. Everything lives in one folder (``formats.profile_folder``)
and is checkpointed every ``checkpoint_seconds``, so an interrupted run resumes
at the last checkpoint.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.profile_folder import (
    FORMAT,
    PAIRS_DIR,
    PLOT_FILE,
    PROFILE_JSON,
    REPORT_JSON,
    STATS_FILE,
    VERSION,
    FiringStats,
    PairStore,
    fired_bits,
    pair_capacity,
    predictor_input,
    read_profile_json,
    write_profile_json,
)
from powerinfer_tools.interfaces import FFNTracer, tracing
from powerinfer_tools.models.base import DecoderModel
from powerinfer_tools.models.layers import FFNTrace
from powerinfer_tools.progress import progress_bar


@dataclass(frozen=True)
class ProfileSettings:
    seq_len: int  # tokens per forward pass, each window with a fresh KV cache
    pairs_mib: int = 1024  # disk cap for the predictor training pairs, all layers together
    seed: int = 0  # which tokens' pairs are kept when the cap is smaller than the corpus
    checkpoint_seconds: float = 30.0  # not part of a run's identity: changing it does not block a resume


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


@dataclass(frozen=True)
class WindowJob:
    """One window of the corpus to profile: its ``tokens``, the first one's position ``start`` in the
    corpus, and which of them (``rows``) become training pairs."""

    index: int
    start: int
    tokens: np.ndarray
    rows: np.ndarray


@dataclass
class WindowRecording:
    """FFN hook for one window: per-layer firing counts, absolute sums and the sampled pairs (``rows``
    of the window's tokens). A mixture's experts each see their own tokens; the recorder lays them out
    as one FFN of ``experts * d_ff`` neurons per layer (``formats.profile_folder``), with routing counts
    and, in each pair, routing bits."""

    rows: np.ndarray
    d_ff: int
    experts: int = 0
    fire_count: dict[int, np.ndarray] = field(default_factory=dict)
    abs_sum: dict[int, np.ndarray] = field(default_factory=dict)
    routed: dict[int, np.ndarray] = field(default_factory=dict)
    pairs: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def add(self, other: "WindowRecording") -> None:
        """Take in the layers ``other`` recorded of the same window (another range of layers)."""
        for mine, theirs in ((self.fire_count, other.fire_count), (self.abs_sum, other.abs_sum),
                             (self.routed, other.routed), (self.pairs, other.pairs)):
            mine.update(theirs)

    def __call__(self, trace: FFNTrace) -> None:
        if trace.expert is not None:
            return self._expert(trace)
        fired = trace.fired
        self.fire_count[trace.layer] = fired.sum(axis=0)
        self.abs_sum[trace.layer] = np.abs(trace.activated).sum(axis=0, dtype=np.float64)
        if len(self.rows):
            x = predictor_input(trace.residual[self.rows])
            self.pairs[trace.layer] = (x, fired[self.rows])

    def _expert(self, trace: FFNTrace) -> None:
        layer, e, width = trace.layer, trace.expert, self.d_ff * self.experts
        if layer not in self.fire_count:
            self.fire_count[layer], self.abs_sum[layer] = np.zeros(width, np.int64), np.zeros(width, np.float64)
            self.routed[layer] = np.zeros(self.experts, np.int64)
            self.pairs[layer] = (np.zeros((len(self.rows), trace.residual.shape[1]), trace.residual.dtype),
                                 np.zeros((len(self.rows), fired_bits(self.d_ff, self.experts)), bool))
        neurons = slice(e * self.d_ff, (e + 1) * self.d_ff)
        self.fire_count[layer][neurons] += trace.fired.sum(axis=0)
        self.abs_sum[layer][neurons] += np.abs(trace.activated).sum(axis=0, dtype=np.float64)
        self.routed[layer][e] += len(trace.tokens)
        sampled = np.isin(self.rows, trace.tokens)  # the sampled tokens routed to this expert ...
        at = np.searchsorted(trace.tokens, self.rows[sampled])  # ... and their rows in the trace
        x, fired = self.pairs[layer]
        x[sampled] = predictor_input(trace.residual[at])
        fired[sampled, neurons] = trace.fired[at]
        fired[sampled, width + e] = True


def windows_of(tokens: np.ndarray, seq_len: int) -> list[np.ndarray]:
    return [tokens[i : i + seq_len] for i in range(0, len(tokens), seq_len)]


def record_window(model: FFNTracer, job: WindowJob) -> WindowRecording:
    """What ``model`` does on one window (a fresh cache): a pure function of the model and the job, so the
    same wherever it runs (``cluster.ray_profiling`` runs it on a Ray cluster)."""
    spec = model.spec
    recording = WindowRecording(job.rows, spec.d_ff, spec.n_experts)
    with tracing(model, recording):
        model.forward(job.tokens, model.new_cache())
    return recording


def record_layers(model: DecoderModel, job: WindowJob, layers: range,
                  entering: np.ndarray | None = None) -> tuple[WindowRecording, np.ndarray]:
    """What ``layers`` (consecutive) do on one window, given the residual stream ``entering`` the first
    (None: the window's embeddings), and the stream leaving the last: a range of layers per node, the
    stream passed on (``cluster.ray_layer_ranges``): each layer recorded as ``record_window`` records it."""
    spec = model.spec
    recording = WindowRecording(job.rows, spec.d_ff, spec.n_experts)
    with tracing(model, recording):
        stages = model.stages(job.tokens, model.new_cache())
        x = stages.embedded if entering is None else entering
        for layer in layers:
            x = stages.layers[layer](x)
    return recording, x


class WindowRecorder(Protocol):
    """Where windows are profiled: ``record`` yields each job's recording, in the jobs' order."""

    def record(self, model: FFNTracer, jobs: list[WindowJob]) -> Iterator[WindowRecording]: ...


class LocalWindows:
    """Windows profiled in this process, one after the other."""

    def record(self, model: FFNTracer, jobs: list[WindowJob]) -> Iterator[WindowRecording]:
        return (record_window(model, job) for job in jobs)


class Profiler:
    """Profiles ``model`` on ``tokens`` into ``folder``, resuming whatever run of the same identity is there."""

    def __init__(self, model: FFNTracer, model_name: str, tokens: np.ndarray, corpus: list[str],
                 folder: Path, settings: ProfileSettings):
        spec = model.spec
        if not spec.ffn.sparse:
            raise PitoolsError(
                f"{model_name}: its FFN is {spec.ffn.value}, which is dense (every neuron fires on every token); "
                "profiling needs a ReLU-family model (ReGLU, dReLU or ReLU)"
            )
        self.model, self.model_name, self.folder, self.settings = model, model_name, Path(folder), settings
        self.windows = windows_of(tokens, settings.seq_len)
        capacity = pair_capacity(len(tokens), spec.n_layers, spec.d_model, spec.d_ff, settings.pairs_mib,
                                 spec.n_experts)
        self.sampler = PairSampler(capacity, len(tokens), settings.seed)
        self.identity = {
            "format": FORMAT,
            "version": VERSION,
            "architecture": spec.architecture.name,
            "ffn": spec.ffn.value,
            "n_layers": spec.n_layers,
            "d_model": spec.d_model,
            "d_ff": spec.d_ff,
            "experts": spec.n_experts,
            "corpus": corpus,
            "corpus_sha256": hashlib.sha256(np.ascontiguousarray(tokens, dtype="<i4").tobytes()).hexdigest(),
            "tokens": len(tokens),
            "seq_len": settings.seq_len,
            "pairs_capacity": capacity,
            "seed": settings.seed,
        }

    def run(self, force: bool = False, progress: bool = True, windows: WindowRecorder | None = None) -> FiringStats:
        """Profile the windows not done yet, each recorded by ``windows`` (default: ``LocalWindows``) and
        added here in corpus order, so the folder is the same wherever they were recorded."""
        stats, done = self._start_or_resume(force)
        spec = self.model.spec
        shape = (self.sampler.capacity, spec.d_model, fired_bits(spec.d_ff, spec.n_experts))
        pairs = PairStore.open(self.folder / PAIRS_DIR, spec.n_layers, shape) if self.sampler.capacity else None
        jobs = self._jobs(done)
        last_checkpoint = time.monotonic()
        bar = progress_bar(total=sum(len(w) for w in self.windows), initial=sum(len(w) for w in self.windows[:done]),
                           unit="tok", desc="profile", enabled=progress)
        with bar:
            for job, recording in zip(jobs, (windows or LocalWindows()).record(self.model, jobs)):
                self._add_window(job, recording, stats, pairs)
                bar.update(len(job.tokens))
                if job.index + 1 == len(self.windows) or \
                        time.monotonic() - last_checkpoint >= self.settings.checkpoint_seconds:
                    self._checkpoint(stats, pairs, job.index + 1)
                    last_checkpoint = time.monotonic()
        return stats

    def _jobs(self, done: int) -> list[WindowJob]:
        starts = [int(s) for s in np.cumsum([0] + [len(w) for w in self.windows])]
        return [WindowJob(w, starts[w], window, self.sampler.rows(w, starts[w], len(window)))
                for w, window in enumerate(self.windows) if w >= done]

    def _add_window(self, job: WindowJob, recording: WindowRecording, stats: FiringStats,
                    pairs: PairStore | None) -> None:
        # Totals change only once the whole window is through, so a checkpoint never holds half a window.
        row = self.sampler.first_row(job.start)
        for layer in range(stats.n_layers):
            stats.fire_count[layer] += recording.fire_count[layer]
            stats.abs_sum[layer] += recording.abs_sum[layer]
            if stats.routed is not None:
                stats.routed[layer] += recording.routed[layer]
            if len(recording.rows):
                pairs.write(layer, row, *recording.pairs[layer])
        stats.tokens += len(job.tokens)

    def _start_or_resume(self, force: bool) -> tuple[FiringStats, int]:
        spec = self.model.spec
        if (self.folder / PROFILE_JSON).is_file() and not force:
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
                stats, metadata = FiringStats.load(self.folder / STATS_FILE, spec.n_layers, spec.d_ff, spec.n_experts)
                return stats, self._windows_done(metadata)
        # Fresh start: the identity is written first, so a run interrupted before
        # its first checkpoint is still recognised (and restarted) next time.
        self.folder.mkdir(parents=True, exist_ok=True)  # a work folder's parents are ours; -o DIR's were checked
        for name in (STATS_FILE, REPORT_JSON, PLOT_FILE):
            (self.folder / name).unlink(missing_ok=True)
        shutil.rmtree(self.folder / PAIRS_DIR, ignore_errors=True)
        self._write_profile_json(windows_done=0, tokens_done=0)
        if self.sampler.capacity:
            PairStore.create(self.folder / PAIRS_DIR, spec.n_layers, spec.d_model,
                             fired_bits(spec.d_ff, spec.n_experts), self.sampler.capacity).flush()
        return FiringStats.zeros(spec.n_layers, spec.d_ff, spec.n_experts), 0

    def _windows_done(self, metadata: dict[str, str]) -> int:
        """How many windows a checkpoint's stats count (written by ``_checkpoint``)."""
        done = metadata.get("windows_done", "")
        if not done.isdigit() or int(done) > len(self.windows):
            raise PitoolsError(f"{self.folder / STATS_FILE}: windows_done is {done!r}, not a count of "
                               f"{len(self.windows)} windows or fewer; use --force to start over")
        return int(done)

    def _checkpoint(self, stats: FiringStats, pairs: PairStore | None, windows_done: int) -> None:
        # Order matters: pairs reach the disk before the stats that count them;
        # the stats file (atomically replaced) is what a resume trusts.
        if pairs is not None:
            pairs.flush()
        # One metadata key (the format is profile.json's): safetensors writes several in its Rust hash
        # map's per-process order, so the same stats would differ in bytes between runs.
        stats.save(self.folder / STATS_FILE, {"windows_done": str(windows_done)})
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
        write_profile_json(self.folder, content)
