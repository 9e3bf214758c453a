"""Neuron predictors: per layer a small MLP that guesses which FFN neurons fire.

PowerInfer's runtime computes ``out = fc2 · relu(fc1 · x)`` on the residual
stream ``x`` entering the FFN block (before its norm; the profile's pairs hold it
scaled per token, see ``formats.profile_folder.predictor_input``) and computes neuron ``j``
only when ``out[j] >= sparse_threshold`` (its sparse kernels skip rows with
``out < threshold``). There is no bias anywhere, so a per-layer threshold shift
cannot be stored; the recall target is reached instead by class weighting
(``predictors.fit``, which also stops hopeless candidates early).

Each layer's hidden size is the smallest of a ladder that reaches the recall
target with at least ``min_precision`` precision (so it does not buy recall by
predicting nearly every neuron), within the layer's share of what is left of the
byte budget for all predictors (a fraction of the FFN weights). The sizes tried
are found by a bracketed search starting at the previous layer's size
(``predictors.search``: O(log) candidates per layer). When no allowed size passes,
the layer keeps the best trade-off among those tried, says so, and training goes
on. Layers whose firing is easy to predict leave their share of the budget to
later layers.

Layers are trained one after another: the matrix products and the fused loss
gradient already use both cores of a small machine, and a layer's pairs are held
in memory (float32, scaled) while it trains. Where the candidates are trained is a
``Candidates`` object's business: here, as the search asks for each
(``LocalCandidates``), or on a Ray cluster ahead of the search
(``powerinfer_tools.cluster.ray_training``); the choices are made here, in layer
order, either way, so both write the same folder.

Training is NumPy, or CuPy when a CUDA GPU is present: the code uses an array
module ``xp``. Initial weights and the batch order come from NumPy generators
seeded by (seed, layer, hidden size), so a run is reproducible, and resumable
per layer: the output folder is rewritten after every layer.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import NamedTuple, Protocol

import numpy as np

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.model_spec import FFNUnit
from powerinfer_tools.formats.predictor_folder import FORMAT, META_FILE, VERSION, PredictorFolder, read_predictors
from powerinfer_tools.formats.predictor_rule import SPARSE_THRESHOLD
from powerinfer_tools.formats.profile_folder import (
    PAIRS_DIR,
    PairStore,
    fired_bits,
    layer_neurons,
    load_profile,
    profile_experts,
    profile_units,
)
from powerinfer_tools.predictors.fit import Fit, Quality, fit_predictor
from powerinfer_tools.predictors.search import best_trade_off, search_sizes
from powerinfer_tools.progress import progress_bar
from powerinfer_tools.xp import cupy_or_none

# Too few samples: a neuron's firing is a threshold on a direction of the d_model-wide input, and a
# linear separator in d dimensions needs a number of samples proportional to d to generalise (its VC
# dimension is d + 1). Measured on a hard model (full-rank firing, d_model 2048): 4,000 pairs (~2 per
# input dimension) left every hidden size from 8 to 128 at 89-92% held-out recall. Below this many
# pairs per input dimension the trainer warns.
PAIRS_PER_INPUT_DIM = 10
CANDIDATES_GUESS = 3  # candidates per layer the progress bar assumes until the first layer is done


@dataclass(frozen=True)
class TrainSettings:
    recall: float = 0.95  # held-out recall every layer must reach
    budget: float = 0.1  # all predictors' parameters / all FFN weight parameters
    min_precision: float = 0.5  # a ladder size passes only at this precision (or better) at the target recall
    epochs: int = 6  # passes over the training pairs, each at least min_epoch_steps batches long
    extra_epochs: int = 8  # further epochs allowed, raising the class weight, when recall is still short
    min_epoch_steps: int = 200  # so that a small profile still gets enough optimiser steps
    batch_size: int = 512
    lr: float = 2e-3
    # The last pairs (the corpus's last tokens) are held out: the first half of them tunes (the class weight,
    # the size search), the second half reports the quality recorded, measured on rows nothing was chosen on.
    val_fraction: float = 0.1
    max_val_pairs: int = 16384
    weight_up: float = 1.5  # class-weight step when recall is short of the target
    weight_down: float = 1.2  # ... and when it exceeds the target by more than recall_slack
    recall_slack: float = 0.01
    seed: int = 0


def hidden_ladder(d_ff: int) -> list[int]:
    """Candidate hidden sizes 8, 12, 16, 24, 32, 48, ... (steps of about sqrt 2), up to ``d_ff``."""
    sizes, base = [], 8
    while base <= d_ff:
        sizes += [s for s in (base, base * 3 // 2) if s <= d_ff]
        base *= 2
    return sizes


def predictor_params(hidden: int, d_model: int, d_ff: int) -> int:
    return hidden * (d_model + d_ff)


def ffn_params(ffn: str, d_model: int, d_ff: int) -> int:
    """Weights of one FFN: gate, up and down for the gated kinds, fc1 and fc2 for OPT's plain ReLU."""
    return (2 if ffn == "relu" else 3) * d_model * d_ff


def array_module(device: str) -> ModuleType:
    """``np`` or ``cupy`` for ``--device auto|cpu|cuda``."""
    if device == "cpu":
        return np
    cupy = cupy_or_none()
    if cupy is None and device == "cuda":
        raise PitoolsError("--device cuda needs CuPy and a CUDA GPU; neither was found (use --device cpu)")
    return cupy if cupy is not None else np


# --- data --------------------------------------------------------------------------------------


@dataclass
class LayerPairs:
    """One layer's pairs: read from the memory maps ``x`` (float16) and ``fired`` (packed bits) once,
    into memory as the steps use them: inputs float32 divided by ``scale``, training masks packed,
    held-out masks bool. (Converting 512 random float16 rows per step cost a quarter of a small
    predictor's step.)"""

    x: np.ndarray  # [n, d_model] float16 memmap
    fired: np.ndarray  # [n, ceil(d_ff/8)] packed bits memmap
    n_train: int  # rows 0 .. n_train-1 train; the rest are held out: the tuning split, then the reporting split
    d_ff: int

    def __post_init__(self):
        sample = np.arange(0, self.n_train, max(1, self.n_train // 16384))
        sample_x = self.x[sample].astype(np.float32)
        self.density = float(self._unpack(self.fired[sample]).mean())
        # Per-feature RMS of the inputs: dividing by it gives Adam equally scaled features.
        self.scale = np.maximum(np.sqrt(np.mean(sample_x * sample_x, axis=0)), 1e-6).astype(np.float32)
        self.train_x = self._scaled(0, self.n_train)
        self.train_fired = np.array(self.fired[: self.n_train])
        tuning_end = self.n_train + (len(self.x) - self.n_train + 1) // 2
        self.val_x = self._scaled(self.n_train, tuning_end)
        self.val_y = self._unpack(self.fired[self.n_train : tuning_end])
        self.report_x = self._scaled(tuning_end, len(self.x))
        self.report_y = self._unpack(self.fired[tuning_end:])

    def _scaled(self, first: int, end: int, chunk: int = 4096) -> np.ndarray:
        out = np.empty((end - first, self.x.shape[1]), np.float32)
        for i in range(first, end, chunk):
            block = out[i - first : min(i + chunk, end) - first]
            block[:] = self.x[i : i + len(block)]
            block /= self.scale
        return out

    def _unpack(self, packed: np.ndarray) -> np.ndarray:
        return np.unpackbits(packed, axis=1, count=self.d_ff).view(bool)

    def batch(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Scaled float32 inputs and bool fired masks of training ``rows``."""
        return self.train_x[rows], self._unpack(self.train_fired[rows])


class UnitRows(NamedTuple):
    """A unit's pairs as stored (float16 inputs, packed fired bits; memory maps for a layer), the
    first ``n_train`` to train on: ``LayerPairs(*rows, d_ff)`` prepares them for training."""

    x: np.ndarray
    fired: np.ndarray
    n_train: int


def unit_rows(store: PairStore, unit: FFNUnit, n_train: int, d_ff: int, experts: int,
              min_train: int) -> UnitRows | None:
    """A unit's pairs: a layer's all; an expert's, those of the tokens routed to it (its routing bit),
    with its own neurons' fired bits, read a chunk of rows at a time. None for an expert the profile
    routed too few tokens to (fewer than ``min_train`` to train on, or fewer than two held out: one to tune
    on, one to report)."""
    if unit.expert is None:
        return UnitRows(store.x[unit.layer], store.fired[unit.layer], n_train)
    x, fired, bits = store.x[unit.layer], store.fired[unit.layer], fired_bits(d_ff, experts)
    neurons = slice(unit.expert * d_ff, (unit.expert + 1) * d_ff)
    rows, packed = [], []
    for start in range(0, len(x), 4096):
        chunk = np.unpackbits(fired[start : start + 4096], axis=1, count=bits).view(bool)
        routed = np.flatnonzero(chunk[:, layer_neurons(d_ff, experts) + unit.expert])
        rows.append(start + routed)
        packed.append(np.packbits(chunk[routed, neurons], axis=1))
    rows = np.concatenate(rows)
    n_routed_train = int(np.searchsorted(rows, n_train))
    if n_routed_train < min_train or len(rows) - n_routed_train < 2:
        return None
    return UnitRows(x[rows], np.concatenate(packed), n_routed_train)


def compute_all(d_model: int, d_ff: int) -> Fit:
    """A predictor that selects every neuron (its outputs are all 0, at the threshold): for an expert the
    profile routed too few tokens to, which then computes densely whenever it is routed. Its recall is
    1 by construction; nothing measured its precision."""
    hidden = hidden_ladder(d_ff)[0]
    every = Quality(recall=1.0, precision=0.0, predicted_density=1.0, true_density=0.0, precision_at_target=0.0)
    return Fit(hidden, np.zeros((hidden, d_model), np.float32), np.zeros((d_ff, hidden), np.float32), every, every,
               pos_weight=0.0, epochs=0, stopped_early=False)


def held_out_pairs(n: int, settings: TrainSettings) -> int:
    """How many of a profile's ``n`` pairs, its last, the trainer holds out (to tune, then to report)."""
    return min(settings.max_val_pairs, int(n * settings.val_fraction))


def open_pairs(profile_dir: Path, meta: dict, settings: TrainSettings) -> tuple[PairStore, int]:
    """The profile's training pairs, checked against ``meta`` (its profile.json), and how many of
    each layer's train (the rest are held out)."""
    shape = (meta["pairs_capacity"], meta["d_model"], fired_bits(meta["d_ff"], profile_experts(meta)))
    store = PairStore.open(Path(profile_dir) / PAIRS_DIR, meta["n_layers"], shape)
    n = meta["pairs_capacity"]
    n_val = held_out_pairs(n, settings)
    if n_val < 2 or n - n_val < settings.batch_size:
        raise PitoolsError(
            f"{profile_dir}: only {n} training pairs per layer; profile more tokens (or raise --pairs-mib)"
        )
    return store, n - n_val


def too_few_pairs(profile_dir: Path, meta: dict, store: PairStore) -> str | None:
    """A one-line warning when the profile holds fewer than PAIRS_PER_INPUT_DIM pairs per input
    dimension, with the tokens (and pair storage) that would do; None when it holds enough."""
    n, d_model = meta["pairs_capacity"], meta["d_model"]
    needed = PAIRS_PER_INPUT_DIM * d_model
    if n >= needed:
        return None
    advice = f"profile at least {needed} tokens"
    if meta["tokens"] > n:  # the pairs were capped by their disk allowance, not by the tokens
        pair_bytes = meta["n_layers"] * (store.x[0].strides[0] + store.fired[0].strides[0])
        advice += f" with --pairs-mib {math.ceil(needed * pair_bytes / 2**20)} or more"
    return (f"warning: {profile_dir}: {n} training pairs per layer for {d_model}-wide inputs; predictors of "
            f"hard-to-predict layers need about {needed} ({PAIRS_PER_INPUT_DIM} per input dimension) to reach "
            f"the recall target: {advice}")


# --- choosing each layer's predictor -----------------------------------------------------------


def passes(fit: Fit, settings: TrainSettings) -> bool:
    return fit.quality.recall >= settings.recall and fit.quality.precision >= settings.min_precision


def choose_predictor(sizes: list[int], start: int, fit, settings: TrainSettings) -> tuple[Fit, list[Fit], bool]:
    """The layer's predictor, every candidate ``fit(hidden)`` trained, and whether it passes: the
    bracketed search's choice (``predictors.search``), else the best trade-off among those tried."""
    chosen, tried = search_sizes(sizes, start, fit, lambda f: passes(f, settings))
    if chosen is None:
        return best_trade_off(tried, settings.recall), tried, False
    return chosen, tried, True


def train_candidate(data: LayerPairs, index: int, hidden: int, settings: TrainSettings, xp: ModuleType) -> Fit:
    """Unit ``index``'s candidate of size ``hidden``, seeded by (seed, unit index, hidden size): the
    same wherever it is trained."""
    return fit_predictor(data, hidden, settings, xp, (settings.seed, index, hidden))


@dataclass(frozen=True)
class UnitJob:
    """One unit's predictor to train: its pairs (read when called), and the sizes and search start it
    would get if every earlier unit of this run used exactly its share of the budget. The real ones
    follow from the earlier units' choices; a cluster searches on this guess ahead of them."""

    index: int
    unit: FFNUnit
    read_rows: Callable[[], UnitRows | None]
    guessed_sizes: list[int]
    guessed_start: int


class Candidates(Protocol):
    """Where candidates are trained. ``start`` is told every unit to train, and how to describe its
    progress (the bar's description); ``load(index)`` comes before unit ``index``'s ``fit``s (in unit
    order) and says whether it has pairs to train on."""

    def start(self, jobs: list[UnitJob], settings: TrainSettings, d_ff: int, device: str,
              describe: Callable[[str], None]) -> None: ...

    def load(self, index: int) -> bool: ...

    def fit(self, index: int, hidden: int) -> Fit: ...


class LocalCandidates:
    """Candidates trained in this process when the search asks for them, one unit's pairs in memory (the
    trainer describes its progress itself)."""

    def start(self, jobs: list[UnitJob], settings: TrainSettings, d_ff: int, device: str,
              describe: Callable[[str], None]) -> None:
        self._jobs = {job.index: job for job in jobs}
        self._settings, self._d_ff, self._xp = settings, d_ff, array_module(device)
        self._data: LayerPairs | None = None

    def load(self, index: int) -> bool:
        self._data = None  # the previous unit's pairs are freed before the next one's are read
        rows = self._jobs[index].read_rows()
        self._data = None if rows is None else LayerPairs(*rows, self._d_ff)
        return self._data is not None

    def fit(self, index: int, hidden: int) -> Fit:
        return train_candidate(self._data, index, hidden, self._settings, self._xp)


def train_predictors(profile_dir: Path, out: Path, settings: TrainSettings, device: str = "auto",
                     force: bool = False, progress: bool = True, candidates: Candidates | None = None) -> dict:
    """Train (or finish training) every layer's predictor from a complete profile; return predictors.json.
    ``candidates`` trains them (default: ``LocalCandidates``, in this process).

    One progress bar counts candidates over all layers (its total re-estimated after every layer
    from the candidates per layer so far); every layer ends with a one-line result."""
    profile_dir, out = Path(profile_dir), Path(out)
    profile, _ = load_profile(profile_dir, require_complete=True)
    if not profile["pairs_capacity"]:
        raise PitoolsError(f"{profile_dir}: the profile holds no training pairs "
                           f"(none are recorded for {profile['architecture']} models)")
    array_module(device)  # an unusable --device fails before anything else is read
    identity = _identity(profile_dir, profile, settings)
    state = _resume(out, identity, force)
    store, n_train = open_pairs(profile_dir, profile, settings)  # every input check before the output exists
    warning = too_few_pairs(profile_dir, profile, store)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    units, d_ff, first = profile_units(profile), profile["d_ff"], len(state.meta["layers"])
    candidates = candidates or LocalCandidates()
    bar = progress_bar(total=(len(units) - first) * CANDIDATES_GUESS, unit="candidate", desc="predictors",
                       enabled=progress)
    log = bar.write if progress else (lambda message: None)
    with bar:
        candidates.start(_unit_jobs(state.meta, units, first, settings, store, n_train, profile_experts(profile)),
                         settings, d_ff, device, bar.set_description)
        out.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()
        for index in range(first, len(units)):
            unit, started = units[index], time.monotonic()
            sizes = _allowed_sizes(state.meta, index, len(units), settings)

            def fit(hidden: int, unit=unit, index=index) -> Fit:
                bar.set_description(f"predictors: {unit}, hidden {hidden}")
                candidate = candidates.fit(index, hidden)
                bar.update(1)
                return candidate

            if not candidates.load(index):
                chosen, tried, reached = compute_all(profile["d_model"], d_ff), [], False
            else:
                chosen, tried, reached = choose_predictor(sizes, _search_start(state.meta["layers"], sizes), fit,
                                                          settings)
            state.set_unit(unit, chosen.fc1, chosen.fc2)
            state.meta["layers"].append(_layer_entry(unit, chosen, tried, reached, profile))
            state.meta["complete"] = index + 1 == len(units)
            state.save(out)
            done, left = index + 1 - first, len(units) - index - 1
            bar.total = bar.n + left * math.ceil(bar.n / done)
            eta = (time.monotonic() - began) / done * left
            log(_result_line(state.meta["layers"][-1], unit, index, len(units), time.monotonic() - started, eta))
    return state.meta


def _unit_jobs(meta: dict, units: list[FFNUnit], first: int, settings: TrainSettings, store: PairStore,
               n_train: int, experts: int) -> list[UnitJob]:
    """The units from ``first`` on, each guessing the sizes of the first (an equal share of what the
    finished units left of the budget) and, but for the first's own, the smallest as its start: a
    search from it tries the size it chooses and the failing one below, all that a search from the
    previous unit's choice needs when that is the same size."""
    if first == len(units):
        return []
    sizes = _allowed_sizes(meta, first, len(units), settings)
    return [UnitJob(index, units[index],
                    partial(unit_rows, store, units[index], n_train, meta["d_ff"], experts, settings.batch_size),
                    sizes, _search_start(meta["layers"], sizes) if index == first else sizes[0])
            for index in range(first, len(units))]


def _identity(profile_dir: Path, profile: dict, settings: TrainSettings) -> dict:
    """What predictors.json records of the profile and settings (a resumed run must match it)."""
    n_layers, d_model, d_ff = profile["n_layers"], profile["d_model"], profile["d_ff"]
    total_ffn = len(profile_units(profile)) * ffn_params(profile["ffn"], d_model, d_ff)
    return {
        "format": FORMAT,
        "version": VERSION,
        "sparse_threshold": SPARSE_THRESHOLD,
        "profile": str(profile_dir.resolve()),
        "profile_corpus_sha256": profile["corpus_sha256"],
        "model": profile.get("model"),
        "n_layers": n_layers,
        "experts": profile_experts(profile),
        "d_model": d_model,
        "d_ff": d_ff,
        "ffn_params": total_ffn,
        "budget_params": int(settings.budget * total_ffn),
        "settings": asdict(settings),
    }


def _search_start(finished: list[dict], sizes: list[int]) -> int:
    """The size the previous layer chose (its best trade-off when none passed: starting at the
    largest it tried instead kept a hard layer at that size when the budget had grown, 81.1% recall
    against 82.8% one step down); the smallest allowed size for the first layer."""
    return finished[-1]["hidden"] if finished else sizes[0]


def _allowed_sizes(meta: dict, index: int, n_units: int, settings: TrainSettings) -> list[int]:
    """The ladder sizes within unit ``index``'s share of what the earlier units left of the budget."""
    d_model, d_ff = meta["d_model"], meta["d_ff"]
    used = sum(predictor_params(e["hidden"], d_model, d_ff) for e in meta["layers"])
    allowed = (meta["budget_params"] - used) / (n_units - index)
    ladder = hidden_ladder(d_ff)
    sizes = [h for h in ladder if predictor_params(h, d_model, d_ff) <= allowed]
    if not sizes:
        raise PitoolsError(
            f"the budget {settings.budget:.1%} of the FFN weights leaves FFN {index} "
            f"{max(allowed, 0):.0f} parameters, less than the smallest predictor "
            f"({predictor_params(ladder[0], d_model, d_ff)}); raise --budget"
        )
    return sizes


def _result_line(entry: dict, unit: FFNUnit, index: int, n_units: int, seconds: float, eta: float) -> str:
    """``layer 3/22: ...``; a mixture's ``layer 3 expert 5 (30/64): ...``."""
    where = f"layer {unit.layer}/{n_units}" if unit.expert is None else f"{unit} ({index + 1}/{n_units})"
    tuned = entry["tuning"]["recall"]
    line = (f"{where}: hidden {entry['hidden']}, recall {entry['recall']:.1%} (tuned to {tuned:.1%}), "
            f"precision {entry['precision']:.1%}, computes {entry['predicted_density']:.1%} of neurons "
            f"({entry['true_density']:.1%} fire); {_count(len(entry['tried']), 'candidate')} in {_duration(seconds)}, "
            f"about {_duration(eta)} left")
    if not entry["tried"]:
        return f"{where}: too few tokens routed to it in the profile to train on: it computes every neuron"
    return line if entry["target_reached"] else line + "; best trade-off: target not reached"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def _layer_entry(unit: FFNUnit, fit: Fit, tried: list[Fit], reached: bool, profile: dict) -> dict:
    """What predictors.json records of a unit's predictor: its quality on the reporting split, on the tuning
    split that chose it (``tuning``), and the search's candidates as the tuning split judged them."""
    q, tuned = fit.reported, fit.quality
    return {
        "layer": unit.layer,
        **({} if unit.expert is None else {"expert": unit.expert}),
        "hidden": fit.hidden,
        "recall": q.recall,
        "precision": q.precision,
        "predicted_density": q.predicted_density,
        "true_density": q.true_density,
        "tuning": {"recall": tuned.recall, "precision": tuned.precision},
        "bytes": 4 * predictor_params(fit.hidden, profile["d_model"], profile["d_ff"]),
        "pos_weight": fit.pos_weight,
        "epochs": fit.epochs,
        "target_reached": reached,
        "tried": [{"hidden": f.hidden, "recall": f.quality.recall, "precision": f.quality.precision,
                   "precision_at_target": f.quality.precision_at_target, "epochs": f.epochs,
                   "stopped_early": f.stopped_early} for f in tried],
    }


def _resume(out: Path, identity: dict, force: bool) -> PredictorFolder:
    if (out / META_FILE).is_file() and not force:
        previous = read_predictors(out, require_complete=False)
        changed = [k for k, v in identity.items() if previous.meta.get(k) != v]
        if changed:
            raise PitoolsError(
                f"{out} holds predictors trained with other settings or from another profile "
                f"(differs: {', '.join(changed)}); use another output folder, or --force to start over"
            )
        # Training adds layers in memory; the finished ones are read from their memory map once.
        return PredictorFolder(previous.meta, {name: np.array(previous.tensors[name]) for name in previous.tensors})
    return PredictorFolder({**identity, "complete": False, "layers": []})
