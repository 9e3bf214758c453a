"""Training-free activation sparsity for SiLU models (CATS, TEAL): calibration, the file, the runtime."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_checks import fails, invoke
from tiny_models import build_tiny_model

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.conversion.convert import convert
from powerinfer_tools.conversion.sparsify import SparsifySettings
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.activation_thresholds import (RULE_KEY, TARGET_KEY, SparsityRule, kept, read_thresholds,
                                                            threshold_key)
from powerinfer_tools.models.layers import gate_activation
from powerinfer_tools.formats.model_file import open_model_file
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.models import FFNKind, load_model
from powerinfer_tools.profiling import calibration as calibration_module
from powerinfer_tools.profiling.calibration import CalibrationSettings, calibrate
from powerinfer_tools.runtime.loader import load_runtime_model
from powerinfer_tools.runtime import thresholded_ffn
from powerinfer_tools.runtime.thresholded_ffn import cats_bounds
from powerinfer_tools.solver.model_stats import read_model_stats

TARGET = 0.4
RULES = list(SparsityRule)


@pytest.fixture(scope="module")
def thresholded_files(silu_model, tmp_path_factory):
    """f32 files of the tiny SiLU model, one per rule at TARGET, and its dense conversion."""
    out = tmp_path_factory.mktemp("files")
    files = {rule: convert(str(silu_model), out / f"{rule.name}.powerinfer.gguf", "f32", progress=False,
                           sparsify=SparsifySettings(tokens=2048, target_sparsity=TARGET, rule=rule))[0]
             for rule in RULES}
    files["dense"] = convert(str(silu_model), out / "dense.gguf", "f32", dense=True, progress=False)[0]
    return files


def _kept_shares(model, tokens, thresholds) -> dict[str, list[float]]:
    """Per kind, per layer: the share of entries each threshold keeps on ``tokens[:256]``, the model running them."""
    shares: dict[str, list[list[float]]] = {}

    def hook(trace):
        t = thresholds.layers[trace.layer]
        cats = kept(gate_activation(FFNKind.SWIGLU)(trace.gate_pre), t.cats)
        if t.cats is not None:
            shares.setdefault("cats", []).append(cats.mean())
        if t.ffn_in is not None:
            shares.setdefault("ffn_in", []).append(kept(trace.ffn_input, t.ffn_in).mean())
        if t.ffn_down is not None:  # among the neurons CATS kept, for cats+teal
            shares.setdefault("ffn_down", []).append(kept(trace.activated[cats], t.ffn_down).mean())

    model.ffn_hook, model.activation_thresholds = hook, thresholds
    model.forward(tokens[:256], model.new_cache())
    model.ffn_hook, model.activation_thresholds = None, None
    return shares


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.value)
def test_calibrated_thresholds_keep_the_target_share_on_calibration_text(silu_model_and_tokens, rule):
    model, tokens = silu_model_and_tokens
    calibration = calibrate(model, tokens, CalibrationSettings(TARGET, rule, seq_len=256), progress=False)
    assert calibration.thresholds.rule is rule and len(calibration.thresholds.layers) == model.spec.n_layers
    shares = _kept_shares(model, tokens, calibration.thresholds)
    assert set(shares) == set(rule.thresholds)
    for kind, per_layer in shares.items():  # the first window is part of what was calibrated on
        assert np.allclose(per_layer, 1 - TARGET, atol=0.03), (kind, per_layer)
    frequencies = np.stack(list(calibration.frequencies.values()))
    # the share of tokens reading a neuron's rows: up rows for CATS (and cats+teal), down rows for TEAL
    assert frequencies.shape == (model.spec.n_layers, model.spec.d_ff)
    assert abs(frequencies.mean() - (1 - TARGET)) < 0.02 and frequencies.std() > 0.01  # some neurons hotter than others


def test_thresholds_set_on_a_subset_of_the_windows_hold_on_the_others(silu_model_and_tokens, monkeypatch):
    """With fewer sampled tokens than calibration tokens (two windows of eight: the first and the last), the
    thresholds keep the target on a window that was never sampled, and frequencies count every token."""
    monkeypatch.setattr(calibration_module, "SAMPLE_TOKENS", 512)
    model, tokens = silu_model_and_tokens
    calibration = calibrate(model, tokens, CalibrationSettings(TARGET, SparsityRule.CATS), progress=False)
    unseen = _kept_shares(model, tokens[3 * 256:], calibration.thresholds)["cats"]
    assert np.allclose(unseen, 1 - TARGET, atol=0.06), unseen
    assert calibration.tokens == len(tokens) == 2048
    assert abs(np.mean(list(calibration.frequencies.values())) - (1 - TARGET)) < 0.04


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.value)
def test_the_file_carries_the_rule_thresholds_and_frequencies(thresholded_files, rule):
    model = open_model_file(thresholded_files[rule])
    thresholds = read_thresholds(model.get, 2, "f")
    assert thresholds.rule is rule and thresholds.target == pytest.approx(TARGET)
    for kind in ("cats", "ffn_in", "ffn_down"):
        values = [getattr(t, kind) for t in thresholds.layers]
        assert all(v is not None and v > 0 for v in values) == (kind in rule.thresholds), (kind, values)
    frequency = np.asarray(model.get("pitools.blk.0.neuron_frequency"))
    assert np.all(np.diff(frequency) <= 0)  # stored hot-first


def _logits(runtime, tokens, one_at_a_time: bool) -> np.ndarray:
    caches = runtime.new_cache()
    if not one_at_a_time:
        return runtime.forward(tokens, caches)
    return np.concatenate([runtime.forward(tokens[i:i + 1], caches) for i in range(len(tokens))])


@pytest.mark.parametrize("one_at_a_time, compiled", [(True, True), (True, False), (False, True)],
                         ids=["compiled decode", "general decode", "prompt"])
@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.value)
def test_sparse_runtime_computes_the_rule_as_the_reference_engine(silu_model, thresholded_files, rule,
                                                                 one_at_a_time, compiled):
    """The runtime's kernels against the NumPy rule on the checkpoint's float weights. A neuron whose value
    lies within float32 rounding of its threshold may be kept by one engine and not the other, so the
    logits must agree closely on most tokens and every token's top choice must be the same."""
    runtime = load_runtime_model(thresholded_files[rule])
    runtime.mode = FFNMode.SPARSE
    runtime.compiled_decoding = compiled  # off: one token through thresholded_ffn.cats_choice and FFNPartition.compute
    reference = load_model(Checkpoint(silu_model))
    reference.activation_thresholds = read_thresholds(open_model_file(thresholded_files[rule]).get, 2, "f")
    tokens = np.arange(3, 40, 3)
    ours, theirs = _logits(runtime, tokens, one_at_a_time), reference.forward(tokens, reference.new_cache())
    close = np.abs(ours - theirs).max(axis=1) < 1e-4
    assert close.mean() >= 0.75, np.abs(ours - theirs).max(axis=1)
    assert np.array_equal(ours.argmax(axis=1), theirs.argmax(axis=1))
    reference.activation_thresholds = None
    assert np.abs(reference.forward(tokens, reference.new_cache()) - theirs).max() > 1e-3  # the rule did something
    assert 0 < runtime.stats.density <= (1.0 if rule is SparsityRule.TEAL else 0.75)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.value)
def test_dense_mode_on_a_thresholded_file_is_the_dense_conversion(thresholded_files, rule):
    tokens = np.arange(5, 30)
    sparse_file, dense_file = load_runtime_model(thresholded_files[rule]), load_runtime_model(thresholded_files["dense"])
    np.testing.assert_allclose(_logits(sparse_file, tokens, True), _logits(dense_file, tokens, True), atol=1e-5)
    np.testing.assert_allclose(_logits(sparse_file, tokens, False), _logits(dense_file, tokens, False), atol=1e-5)


def test_perplexity_reports_the_computed_density(thresholded_files, silu_model):
    result = invoke("perplexity", thresholded_files[SparsityRule.CATS], "--mode", "sparse", "--json",
                    "--corpus", silu_model / "heldout.txt", "--tokens", 1024)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["selection"]["computed_density"] == pytest.approx(1 - TARGET, abs=0.06)


def test_solve_places_a_thresholded_model_by_its_frequencies(thresholded_files, tmp_path):
    path = thresholded_files[SparsityRule.CATS]
    split = tmp_path / "model.gpuidx"
    result = invoke("solve", path, "--vram", "1MB", "--reserve", "0B", "-o", split)
    assert result.exit_code == 0, result.output
    tokens = np.arange(7, 20)
    with_split, without = load_runtime_model(path, split=split), load_runtime_model(path)
    for runtime in (with_split, without):
        runtime.mode = FFNMode.SPARSE
    assert with_split.device is not None
    np.testing.assert_allclose(_logits(with_split, tokens, False), _logits(without, tokens, False), atol=1e-4)
    assert with_split.stats.device_share > 0


def test_target_sparsity_is_refused_where_it_does_not_apply(silu_model, tmp_path):
    relu = build_tiny_model(tmp_path / "relu", seed=1)
    fails("convert", relu, "--target-sparsity", "0.5", "-o", tmp_path / "r.gguf", match="for SiLU and GeGLU models")
    fails("convert", silu_model, "--target-sparsity", "0.5", "--dense", "-o", tmp_path / "d.gguf",
          match="--dense writes the dense layout")
    fails("convert", silu_model, "--target-sparsity", "0.5", "--no-sparsity", "-o", tmp_path / "n.gguf",
          match="contradict")
    assert invoke("convert", silu_model, "--target-sparsity", "1", "-o", tmp_path / "x.gguf").exit_code == 2
    assert not any(tmp_path.glob("*.gguf"))


@pytest.mark.parametrize("metadata, match", [
    ({RULE_KEY: "magic"}, "expected one of cats, teal, cats+teal"),
    ({RULE_KEY: "cats", TARGET_KEY: 1.5}, "must be a number in [0, 1)"),
    ({RULE_KEY: "cats", TARGET_KEY: 0.5}, "must hold 2 finite non-negative thresholds"),
    ({RULE_KEY: "cats", TARGET_KEY: 0.5, threshold_key("cats"): [0.1, -1.0]}, "non-negative"),
    ({RULE_KEY: "teal", TARGET_KEY: 0.5, threshold_key("ffn_in"): [0.1, 0.2]}, "threshold.ffn_down"),
])
def test_bad_threshold_metadata_is_one_clear_error(metadata, match):
    with pytest.raises(PitoolsError, match=None) as error:
        read_thresholds(metadata.get, 2, "model.gguf")
    assert match in str(error.value) and str(error.value).startswith("model.gguf: ")


def test_the_solver_counts_every_gate_row_of_a_cats_model_as_read(thresholded_files):
    for rule, expected in ((SparsityRule.CATS, lambda f: (1 + 2 * f) / 3), (SparsityRule.TEAL, lambda f: f)):
        recorded = np.asarray(open_model_file(thresholded_files[rule]).get("pitools.blk.1.neuron_frequency"))
        # f32: a neuron's gate, up and down rows are the same size, a third of its bytes each
        np.testing.assert_allclose(read_model_stats(thresholded_files[rule])["freqs"][1], expected(recorded),
                                   rtol=1e-6)


@pytest.mark.parametrize("kind", [FFNKind.SWIGLU, FFNKind.GEGLU], ids=lambda k: k.value)
@pytest.mark.parametrize("t", [0.0, 0.01, 0.1, 0.16, 0.25, 0.3, 2.0])
def test_cats_bounds_keep_exactly_where_the_activation_clears_the_threshold(kind, t):
    """The compiled decoder keeps a neuron by comparing its gate product with ``cats_bounds`` (no exp or tanh):
    on a fine grid of gate products that must be |act(g)| > t everywhere but within the bounds' margin, on both
    sides of the activation's minimum (SiLU's -0.28, GELU's -0.17: a band below zero for small t, none above)."""
    g = np.linspace(-60, 6, 2_000_001)
    above, band_lo, band_hi, margin = cats_bounds(t, kind)
    wrong = (np.abs(gate_activation(kind)(g)) > t) != ((g > above) | ((band_lo < g) & (g < band_hi)))
    near = np.abs(g[:, None] - np.array([above, band_lo, band_hi])).min(axis=1) < margin
    assert not (wrong & ~near).any(), g[wrong & ~near][:5]
    assert (band_lo < band_hi) == (t < -gate_activation(kind)(np.linspace(-3, 0, 30001)).min())


def test_cats_bounds_follow_the_rules_one_test(monkeypatch):
    """The bounds are bisected on ``clears`` itself: a one-sided test (act(g) > t, no band below zero) moves them
    without an edit to ``cats_bounds``."""
    monkeypatch.setattr(thresholded_ffn, "clears", lambda value, threshold: value > threshold)
    above, band_lo, band_hi, _ = cats_bounds(0.1, FFNKind.SWIGLU)
    assert (band_lo, band_hi) == (0.0, 0.0)  # the two-sided test has a band at t = 0.1 (SiLU's minimum: -0.28)
    assert gate_activation(FFNKind.SWIGLU)(np.float64(above)) == pytest.approx(0.1, abs=1e-9)
