"""Sparsity chosen by quality (``convert --max-quality-loss``): allocation, held-out choice, the file, the CLI."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from cli_checks import fails, invoke
from powerinfer_tools.formats.activation_thresholds import SparsityRule, read_thresholds
from powerinfer_tools.formats.constants import (
    SPARSITY_CURVE_PERPLEXITY_KEY,
    SPARSITY_CURVE_SPARSITY_KEY,
)
from powerinfer_tools.formats.model_file import open_model_file
from tiny_models import build_tiny_model

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.profiling import quality
from powerinfer_tools.profiling.perplexity import perplexity

TOKENS = 2048


def test_allocation_raises_the_cheap_layers_first_and_reaches_the_mean():
    grid = np.asarray(quality.GRID)
    costs = np.stack([grid ** 2, 10 * grid ** 2, grid ** 4])  # layer 1 ten times as sensitive as layer 0
    allocation = quality.allocate(costs, 0.3)
    assert np.isclose(np.mean(allocation), 0.3)
    assert allocation[1] < allocation[0] <= allocation[2]
    assert quality.allocate(costs, 0.0) == (0.0, 0.0, 0.0)
    assert quality.allocate(costs, 0.99) == (grid[-1],) * 3  # at most the grid's top


def test_the_choice_is_the_sparsest_point_within_the_limit_and_never_sees_the_held_out_tokens(silu_model_and_tokens,
                                                                                            monkeypatch):
    model, tokens = silu_model_and_tokens
    seen = []
    for name in ("sensitivity", "calibrate"):
        real = getattr(quality, name)
        monkeypatch.setattr(quality, name, lambda m, t, *a, real=real, **k: seen.append(len(t)) or real(m, t, *a, **k))
    _, held = quality.held_out_split(tokens)
    limit = 0.006  # tight: the tiny model's curve crosses it below the top point
    calibration = quality.choose_sparsity(model, tokens, SparsityRule.CATS, limit, 256, progress=False)
    assert seen and all(n == len(tokens) - len(held) for n in seen)  # thresholds set on the rest only

    choice = calibration.thresholds.choice
    curve = dict(zip(choice.curve_sparsity, choice.curve_perplexity))
    assert list(curve) == [0.0, *quality.POINTS]
    within = [p for p, value in curve.items() if p and value <= curve[0.0] * (1 + limit)]
    assert within and calibration.thresholds.target == max(within) < max(quality.POINTS)
    assert choice.loss <= limit
    # the recorded perplexity is the file's thresholds' on the held-out tokens
    seq_len = min(256, model.spec.max_positions)  # choose_sparsity's windows
    recomputed = perplexity(model, held, seq_len, progress=False, thresholds=calibration.thresholds).perplexity
    assert np.isclose(recomputed, choice.perplexity, rtol=1e-6)


def test_no_point_within_the_limit_is_one_clear_error(silu_model_and_tokens, monkeypatch):
    """Every thresholded point made twice as perplexed as it is: none is within 5%."""
    model, tokens = silu_model_and_tokens

    def doubled(*args, thresholds=None, **kwargs):
        result = perplexity(*args, thresholds=thresholds, **kwargs)
        return result if thresholds is None else dataclasses.replace(result, perplexity=2 * result.perplexity)

    monkeypatch.setattr(quality, "perplexity", doubled)
    with pytest.raises(PitoolsError, match="no sparsity keeps held-out perplexity within 5.0% of dense"):
        quality.choose_sparsity(model, tokens, SparsityRule.CATS, 0.05, 256, progress=False)


def test_convert_records_the_choice_and_the_curve_and_reports_them(silu_model, tmp_path):
    output = tmp_path / "chosen.powerinfer.gguf"
    result = invoke("convert", silu_model, "--max-quality-loss", "2%", "--sparsity-rule", "cats+teal",
                    "--tokens", TOKENS, "--outtype", "f32", "-o", output)
    assert result.exit_code == 0, result.output
    model = open_model_file(output)
    thresholds = read_thresholds(model.get, 2, output.name)
    choice = thresholds.choice
    assert thresholds.rule is SparsityRule.CATS_TEAL and choice.max_loss == pytest.approx(0.02)
    assert len(choice.curve_sparsity) == len(choice.curve_perplexity) == len(quality.POINTS) + 1
    assert 0 < thresholds.target and choice.loss <= 0.02
    assert "held-out perplexity by sparsity" in result.stderr
    assert f"chose {thresholds.target:.0%} sparsity within 2.0%" in result.stderr


def test_a_curve_of_two_lengths_is_refused():
    metadata = {"pitools.sparsity.rule": "cats", "pitools.sparsity.target": 0.3,
                "pitools.sparsity.threshold.cats": [0.1, 0.2], "pitools.sparsity.max_quality_loss": 0.05,
                "pitools.sparsity.perplexity": 10.0, SPARSITY_CURVE_SPARSITY_KEY: [0.0, 0.1],
                SPARSITY_CURVE_PERPLEXITY_KEY: [9.0]}
    with pytest.raises(PitoolsError, match="curve.perplexity must hold 2 finite perplexities >= 1, not \\[9.0\\]"):
        read_thresholds(metadata.get, 2, "model.gguf")


@pytest.mark.parametrize("loss", ["5%", "0.05", " 5 % "])
def test_a_loss_is_a_percentage_or_a_fraction(loss):
    from powerinfer_tools.commands.convert import quality_loss

    assert quality_loss(loss) == pytest.approx(0.05)


@pytest.mark.parametrize("loss, match", [
    ("5", "at most 100% (a fraction at most 1), got 500.00%"), ("0%", "above 0%"), ("150%", "got 150.00%"),
    ("nan", "got nan%"), ("five", "a percentage (5%) or a fraction (0.05)"),
])
def test_a_bad_loss_is_one_clear_error(silu_model, tmp_path, loss, match):
    fails("convert", silu_model, "--max-quality-loss", loss, "-o", tmp_path / "x.gguf", match=match)
    assert not any(tmp_path.glob("*.gguf"))


def test_target_sparsity_and_max_quality_loss_exclude_each_other(silu_model, tmp_path):
    fails("convert", silu_model, "--max-quality-loss", "5%", "--target-sparsity", "0.5", "-o", tmp_path / "x.gguf",
          match="--target-sparsity and --max-quality-loss are two ways to choose the sparsity: give one")
    fails("convert", silu_model, "--max-quality-loss", "5%", "--no-sparsity", "-o", tmp_path / "x.gguf",
          match="--max-quality-loss and --no-sparsity contradict each other")
    relu = build_tiny_model(tmp_path / "relu", seed=1)
    fails("convert", relu, "--max-quality-loss", "5%", "-o", tmp_path / "r.gguf", match="for SiLU and GeGLU models")
