"""The sparsity steps of ``pitools convert``: profile the model, train its predictors, order neurons;
or, for a SiLU model given a target sparsity, calibrate its thresholds (``profiling/calibration.py``).

Both steps cache their results in a work folder beside the output
(``<output>.work/profile`` and ``<output>.work/predictors``) and resume an
interrupted run, so converting again after a crash, or in another output type,
does not redo them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from powerinfer_tools.conversion.reorder import hot_first_permutation, profile_permutations
from powerinfer_tools.conversion.source import open_source
from powerinfer_tools.conversion.stored_weights import StoredWeights
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.model_spec import FFNUnit
from powerinfer_tools.formats.profile_folder import load_profile, profile_units
from powerinfer_tools.formats.quantization import OutType
from powerinfer_tools.models import DecoderModel, checkpoint_spec, load_model
from powerinfer_tools.formats.activation_thresholds import ActivationThresholds, SparsityRule
from powerinfer_tools.interfaces import Workers
from powerinfer_tools.predictors.trainer import TrainSettings, train_predictors
from powerinfer_tools.profiling.calibration import Calibration, CalibrationSettings, calibrate
from powerinfer_tools.profiling.corpus import CorpusSource, read_tokens, resolve_source
from powerinfer_tools.profiling.profiler import Profiler, ProfileSettings, WindowRecorder
from powerinfer_tools.profiling.quality import choose_sparsity


@dataclass(frozen=True)
class SparsifySettings:
    corpus: tuple[Path, ...] = ()  # default: the heldout.txt of the checkpoint folder (or beside the GGUF file)
    tokens: int = 50_000
    seq_len: int = 256
    train: TrainSettings = field(default_factory=TrainSettings)
    reorder: bool = True
    # A SiLU model: thresholds calibrated to this sparsity by ``rule`` instead of predictors, or to the sparsity
    # whose held-out perplexity is at most this relative increase over dense (profiling/quality.py).
    target_sparsity: float | None = None
    rule: SparsityRule = SparsityRule.CATS
    max_quality_loss: float | None = None

    def __post_init__(self):
        if self.target_sparsity is not None and self.max_quality_loss is not None:
            raise PitoolsError("--target-sparsity and --max-quality-loss are two ways to choose the sparsity: "
                               "give one")
        if self.max_quality_loss is not None and not 0 < self.max_quality_loss <= 1:  # NaN fails too
            raise PitoolsError(f"--max-quality-loss must be above 0% and at most 100% (a fraction at most 1), "
                               f"got {self.max_quality_loss:.2%}")

    @property
    def thresholded(self) -> bool:
        """Whether thresholds are calibrated (a SiLU model's sparsity) rather than predictors trained."""
        return self.target_sparsity is not None or self.max_quality_loss is not None


@dataclass(frozen=True)
class SparsityArtifacts:
    """What the converter writes into a PowerInfer file beyond the checkpoint's weights, per FFN (a
    layer's, or an expert's)."""

    predictors: Path | None  # predictor folder (formats/README.md); None for a thresholded model
    frequencies: dict[FFNUnit, np.ndarray] | None  # firing probability per neuron, in the checkpoint's order
    orders: dict[FFNUnit, np.ndarray] | None  # file neuron i is checkpoint neuron orders[unit][i]
    routing: np.ndarray | None = None  # a mixture's [n_layers, experts]: share of tokens routed to each
    thresholds: ActivationThresholds | None = None  # a SiLU model's, instead of predictors


def work_folder(output: Path) -> Path:
    return output.with_name(output.name + ".work")


def model_on_corpus(source: Path, settings: SparsifySettings, stored_as: OutType | None = None
                    ) -> tuple[DecoderModel, CorpusSource, np.ndarray]:
    """The reference engine on ``source`` (a checkpoint folder or a GGUF file), the calibration corpus
    (by default the heldout.txt beside the model) and its tokens, read by the model's own tokenizer. With
    ``stored_as``, the engine's weights are those a PowerInfer file of that type holds (``StoredWeights``)."""
    checkpoint = open_source(source)
    if stored_as is not None:
        spec = checkpoint_spec(checkpoint)
        checkpoint = StoredWeights(checkpoint, spec, stored_as, powerinfer=True)
    model = load_model(checkpoint)
    corpus = resolve_source(settings.corpus, None, checkpoint.folder)
    return model, corpus, read_tokens(corpus, checkpoint.tokenizer(model.spec), settings.tokens)


def profile_checkpoint(source: Path, profile_dir: Path, settings: SparsifySettings, progress: bool,
                       windows: WindowRecorder | None = None) -> None:
    """Profile (or finish profiling) ``source``, a checkpoint folder or a GGUF file, into ``profile_dir``, its
    windows recorded by ``windows`` (default: in this process)."""
    model, corpus, tokens = model_on_corpus(source, settings)
    seq_len = min(settings.seq_len, model.spec.max_positions)
    Profiler(model, str(source), tokens, corpus.describe(), profile_dir, ProfileSettings(seq_len=seq_len)).run(
        progress=progress, windows=windows
    )


def calibrate_checkpoint(source: Path, settings: SparsifySettings, progress: bool, outtype: OutType) -> Calibration:
    """Thresholds for ``source``'s model at ``settings.target_sparsity``, or within ``settings.max_quality_loss``,
    calibrated on its corpus, on the weights a thresholded file of ``outtype`` holds."""
    model, _, tokens = model_on_corpus(source, settings, stored_as=outtype)
    if settings.max_quality_loss is not None:
        return choose_sparsity(model, tokens, settings.rule, settings.max_quality_loss, settings.seq_len,
                               progress=progress)
    return calibrate(model, tokens, CalibrationSettings(settings.target_sparsity, settings.rule, settings.seq_len),
                     progress)


def thresholded_artifacts(calibration: Calibration, reorder: bool) -> SparsityArtifacts:
    """What a thresholded file carries: thresholds, frequencies and (``reorder``) hot-first neurons."""
    frequencies = calibration.frequencies
    orders = {unit: hot_first_permutation(f) for unit, f in frequencies.items()} if reorder else None
    return SparsityArtifacts(None, frequencies, orders, thresholds=calibration.thresholds)


def prepare_sparsity(
    source: Path,
    work: Path,
    settings: SparsifySettings,
    profile_dir: Path | None = None,
    predictors_dir: Path | None = None,
    progress: bool = True,
    workers: Workers | None = None,
) -> SparsityArtifacts:
    """Profile ``source`` (a checkpoint folder or a GGUF file) unless ``profile_dir`` is given, train
    predictors (``train_predictors``) unless ``predictors_dir`` is given; on ``workers`` when given (``--ray``).

    Given predictors alone (no profile), neurons keep their order and the file
    carries no firing frequencies (``pitools solve`` then needs a profile).
    """
    if predictors_dir is not None and profile_dir is None:
        return SparsityArtifacts(predictors_dir, None, None)
    if profile_dir is None:
        profile_dir = work / "profile"
        profile_checkpoint(source, profile_dir, settings, progress, workers and workers.windows)
    if predictors_dir is None:
        predictors_dir = work / "predictors"
        train_predictors(profile_dir, predictors_dir, settings.train, progress=progress,
                         candidates=workers and workers.candidates)
    meta, stats = load_profile(profile_dir, require_complete=True)
    units, d_ff = profile_units(meta), meta["d_ff"]
    frequencies = {unit: stats.unit_frequencies(unit, d_ff) for unit in units}
    orders = profile_permutations(stats, units, d_ff) if settings.reorder else None
    routing = None if stats.routed is None else stats.routed / max(stats.tokens, 1)
    return SparsityArtifacts(predictors_dir, frequencies, orders, routing)
