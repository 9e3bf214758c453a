"""pitools train-predictors: gradients, the hidden-size ladder under a budget, the folder format, resuming."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from cli_checks import invoke
from powerinfer_tools.formats.predictor_folder import predictor_report
from powerinfer_tools.formats.predictor_rule import predict
from powerinfer_tools.formats.profile_folder import PAIRS_DIR, PROFILE_JSON, PairStore
from safetensors.numpy import load_file
from synthetic_profiles import write_synthetic_profile
from tiny_models import run_profiler

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.models import load_model
from powerinfer_tools.predictors import trainer as predictors
from powerinfer_tools.predictors import fit as predictors_fit
from powerinfer_tools.predictors.fit import gradients
from powerinfer_tools.predictors.trainer import TrainSettings, hidden_ladder, train_predictors

FAST = TrainSettings(budget=0.3, batch_size=128, epochs=6)


@pytest.fixture(scope="module")
def profile_dir(sparse_tiny, tmp_path_factory):
    """A finished profile of the sparse tiny model: 3000 tokens, 300 of them held out."""
    folder = tmp_path_factory.mktemp("sparse-tiny-profile") / "prof"
    run_profiler(load_model(Checkpoint(sparse_tiny)), np.random.default_rng(0).integers(0, 256, 3000), folder)
    return folder


@pytest.fixture(scope="module")
def trained(profile_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("pred")
    return train_predictors(profile_dir, out, FAST, device="cpu", progress=False), out


def bce(w1, w2, x, y, pos_weight):
    logits = np.maximum(x @ w1.T, 0) @ w2.T
    return -(pos_weight * y * -np.logaddexp(0, -logits) + (1 - y) * -np.logaddexp(0, logits)).sum() / len(x)


def test_gradients_match_finite_differences():
    rng = np.random.default_rng(0)
    w1, w2 = rng.standard_normal((5, 7)), rng.standard_normal((9, 5))
    x, y = rng.standard_normal((11, 7)), rng.random((11, 9)) < 0.3
    analytic = gradients(np, w1, w2, x, y, 4.0)
    eps = 1e-6
    for w, g in ((w1, analytic[0]), (w2, analytic[1])):
        numeric = np.zeros_like(w)
        for idx in np.ndindex(w.shape):
            saved = w[idx]
            w[idx] = saved + eps
            up = bce(w1, w2, x, y, 4.0)
            w[idx] = saved - eps
            down = bce(w1, w2, x, y, 4.0)
            w[idx] = saved
            numeric[idx] = (up - down) / (2 * eps)
        np.testing.assert_allclose(g, numeric, rtol=1e-5, atol=1e-8)


def test_hidden_ladder():
    assert hidden_ladder(1024) == [8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
    assert hidden_ladder(100) == [8, 12, 16, 24, 32, 48, 64, 96]


def test_prediction_follows_powerinfers_rule():
    """A neuron is computed when fc2 · relu(fc1 · x) >= threshold: an output of exactly 0 counts at threshold 0."""
    fc1 = np.array([[1.0, 0.0]])
    fc2 = np.array([[1.0], [-1.0], [0.0]])
    x = np.array([[2.0, 5.0], [-2.0, 5.0]])  # hidden 2, then hidden 0 (relu)
    np.testing.assert_array_equal(predict(fc1, fc2, x), [[True, False, True], [True, True, True]])
    np.testing.assert_array_equal(predict(fc1, fc2, x, threshold=0.5), [[True, False, False], [False] * 3])


def test_every_layer_reaches_recall_within_budget(trained, profile_dir):
    meta, out = trained
    saved = json.loads((out / "predictors.json").read_text())
    assert saved == json.loads(json.dumps(meta))
    assert saved["complete"] and saved["sparse_threshold"] == 0.0 and len(saved["layers"]) == 2
    weights = load_file(out / "predictors.safetensors")  # plain safetensors, no pitools needed
    assert sorted(weights) == ["blk.0.fc1.weight", "blk.0.fc2.weight", "blk.1.fc1.weight", "blk.1.fc2.weight"]
    store = PairStore.open(profile_dir / PAIRS_DIR, 2)
    n_val = int(len(store.x[0]) * FAST.val_fraction)
    params = 0
    for entry in saved["layers"]:
        fc1, fc2 = weights[f"blk.{entry['layer']}.fc1.weight"], weights[f"blk.{entry['layer']}.fc2.weight"]
        assert fc1.shape == (entry["hidden"], 64) and fc2.shape == (160, entry["hidden"])
        assert fc1.dtype == fc2.dtype == np.float32
        # Recompute the recorded quality from the saved weights on the held-out (last) pairs: the tuning split,
        # then the reporting split, which nothing was chosen on.
        for recorded, rows in ((entry["tuning"], slice(-n_val, -(n_val // 2))), (entry, slice(-(n_val // 2), None))):
            x = store.x[entry["layer"]][rows].astype(np.float32)
            fired = np.unpackbits(store.fired[entry["layer"]][rows], axis=1, count=160).astype(bool)
            pred = predict(fc1, fc2, x)
            assert recorded["recall"] == pytest.approx((pred & fired).sum() / fired.sum(), abs=1e-6)
            assert recorded["precision"] == pytest.approx((pred & fired).sum() / pred.sum(), abs=1e-6)
        assert entry["tuning"]["recall"] >= FAST.recall
        # The search's choice: the smallest size tried that passes both targets, whose ladder neighbour
        # below (if any) was tried and failed; else the most precise at the recall target.
        reaching = [t for t in entry["tried"] if t["recall"] >= FAST.recall]
        passing = [t for t in reaching if t["precision"] >= FAST.min_precision]
        if passing:
            assert entry["target_reached"] and entry["hidden"] == min(t["hidden"] for t in passing)
            ladder = hidden_ladder(160)
            below = ladder[ladder.index(entry["hidden"]) - 1] if entry["hidden"] > ladder[0] else None
            assert below is None or below in {t["hidden"] for t in entry["tried"] if t not in passing}
        else:
            assert not entry["target_reached"]
            assert entry["tuning"]["precision"] == max(t["precision"] for t in reaching)
        params += fc1.size + fc2.size
    assert params <= FAST.budget * saved["ffn_params"] == FAST.budget * 2 * 3 * 64 * 160
    report = predictor_report(saved)
    assert report["all_layers_reach_recall"] and report["total_bytes"] == 4 * params


def test_skewed_layer_gets_a_smaller_predictor(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4000, 24)).astype(np.float32)
    x[:, 0] = 1  # a constant feature lets the predictor draw thresholds without a bias
    skewed = np.zeros((4000, 48), bool)
    skewed[:, :6] = True  # the same few neurons fire on every token
    planes = rng.standard_normal((48, 23))
    spread = x[:, 1:] @ (planes / np.linalg.norm(planes, axis=1, keepdims=True)).T > 1.0  # each its own hyperplane
    write_synthetic_profile(tmp_path / "prof", x, [skewed, spread])
    meta = train_predictors(tmp_path / "prof", tmp_path / "pred", TrainSettings(budget=1.0, batch_size=128),
                            device="cpu", progress=False)
    sizes = [e["hidden"] for e in meta["layers"]]
    assert sizes[0] == 8 < sizes[1]
    assert all(e["tuning"]["recall"] >= 0.95 and e["tuning"]["precision"] >= 0.5 for e in meta["layers"])


def test_interrupted_training_resumes_at_the_next_layer(profile_dir, trained, tmp_path, monkeypatch):
    reference, reference_out = trained
    real_fit = predictors.fit_predictor
    fitted_layers = []

    def fit_until_layer_1(data, hidden, settings, xp, seed):
        fitted_layers.append(seed[1])
        if seed[1] == 1:
            raise KeyboardInterrupt
        return real_fit(data, hidden, settings, xp, seed)

    monkeypatch.setattr(predictors, "fit_predictor", fit_until_layer_1)
    with pytest.raises(KeyboardInterrupt):
        train_predictors(profile_dir, tmp_path, FAST, device="cpu", progress=False)
    partial = json.loads((tmp_path / "predictors.json").read_text())
    assert [e["layer"] for e in partial["layers"]] == [0] and not partial["complete"]

    fitted_layers.clear()
    monkeypatch.setattr(predictors, "fit_predictor", lambda *a: fitted_layers.append(a[4][1]) or real_fit(*a))
    resumed = train_predictors(profile_dir, tmp_path, FAST, device="cpu", progress=False)
    assert set(fitted_layers) == {1}  # layer 0 was not trained again
    assert resumed["layers"] == reference["layers"]  # and the seeded run is reproducible
    ours, theirs = load_file(tmp_path / "predictors.safetensors"), load_file(reference_out / "predictors.safetensors")
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name])


def test_other_settings_refused_and_small_budget_explained(profile_dir, trained):
    _, out = trained
    with pytest.raises(PitoolsError, match="differs: budget_params, settings"):
        train_predictors(profile_dir, out, TrainSettings(budget=0.2), device="cpu", progress=False)
    with pytest.raises(PitoolsError, match="less than the smallest predictor"):
        train_predictors(profile_dir, out / "tiny", TrainSettings(budget=0.01), device="cpu", progress=False)


def test_cuda_without_cupy_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(predictors, "cupy_or_none", lambda: None)
    with pytest.raises(PitoolsError, match="--device cuda needs CuPy"):
        predictors.array_module("cuda")
    assert predictors.array_module("auto") is np


def test_cli_trains_and_reports(profile_dir, tmp_path):
    result = invoke("train-predictors", str(profile_dir), "-o", str(tmp_path), "--budget", "0.3", "--epochs", "1",
                    "--min-precision", "0", "--device", "cpu", "-q")
    assert result.exit_code == 0, result.stderr
    assert "every layer at the recall target on the rows it was tuned on: yes" in result.stdout
    report = invoke("train-predictors", "--report", str(tmp_path), "--json")
    assert report.exit_code == 0, report.stderr
    layers = json.loads(report.stdout)["layers"]
    assert [e["layer"] for e in layers] == [0, 1] and json.loads(report.stdout)["all_layers_reach_recall"]
    unfinished = invoke("train-predictors", str(profile_dir), "-q")
    assert unfinished.exit_code == 1 and "give a profile DIR and -o PRED" in unfinished.stderr


QUICK = TrainSettings(budget=1.0, batch_size=64, min_epoch_steps=100, epochs=4, extra_epochs=2)


def unpredictable_and_easy_profile(folder, n=2000):
    """Layer 0 fires at random (no size can pass); layer 1 on hyperplanes of a 4-dimensional subspace."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, 16)).astype(np.float32)
    x[:, 0] = 1
    noise = rng.random((n, 32)) < 0.1
    planes = rng.standard_normal((4, 32))
    easy = x[:, 1:5] @ (planes / np.linalg.norm(planes, axis=0)) > 1.0
    write_synthetic_profile(folder, x, [noise, easy])


def test_early_stop_rule():
    assert not predictors_fit.cannot_pass([0.1, 0.1], 0.5, 5)  # two epochs say nothing about the trend
    assert predictors_fit.cannot_pass([0.10, 0.12, 0.13], 0.5, 3)  # flattening: 0.13 + 3 x 0.01 < 0.5
    assert not predictors_fit.cannot_pass([0.10, 0.12, 0.20], 0.5, 3)  # rising faster: not flattening
    assert predictors_fit.cannot_pass([0.100, 0.098, 0.104], 0.5, 3)  # a plateau's noise is flat
    assert not predictors_fit.cannot_pass([0.10, 0.25, 0.35], 0.5, 3)  # 0.35 + 3 x 0.10 could get there
    assert predictors_fit.cannot_pass([0.30, 0.28, 0.25], 0.5, 3)  # falling
    assert predictors_fit.cannot_pass([0.40, 0.44, 0.45], 0.5, 0)  # in the extra epochs: below is below
    assert not predictors_fit.cannot_pass([0.40, 0.44, 0.55], 0.5, 0)


def test_a_candidate_that_cannot_pass_stops_early(tmp_path):
    unpredictable_and_easy_profile(tmp_path)
    store = PairStore.open(tmp_path / PAIRS_DIR, 2)
    data = predictors.LayerPairs(store.x[0], store.fired[0], 1800, 32)
    stopped = predictors_fit.fit_predictor(data, 8, QUICK, np, (0, 0, 8))
    full = predictors_fit.fit_predictor(data, 8, replace(QUICK, min_precision=0.0), np, (0, 0, 8))
    assert stopped.stopped_early and stopped.epochs == 3  # random firing: precision ~10% at any cutoff
    assert not full.stopped_early and full.epochs == QUICK.epochs + QUICK.extra_epochs  # recall stays short
    assert full.quality.precision_at_target < QUICK.min_precision  # so it could not have passed
    easy = predictors_fit.fit_predictor(predictors.LayerPairs(store.x[1], store.fired[1], 1800, 32), 8, QUICK,
                                        np, (0, 1, 8))
    assert not easy.stopped_early and easy.epochs >= QUICK.epochs


def test_precision_at_target_recall_matches_a_sorted_count():
    rng = np.random.default_rng(0)
    w1, w2 = rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal((10, 4)).astype(np.float32)
    x, y = rng.standard_normal((300, 6)).astype(np.float32), rng.random((300, 10)) < 0.3
    q = predictors_fit.evaluate(np, w1, w2, x, y, 0.9)
    out = np.maximum(x @ w1.T, 0) @ w2.T
    cutoff = np.sort(out[y])[::-1][int(np.ceil(0.9 * y.sum())) - 1]  # the lowest output kept at 90% recall
    assert q.precision_at_target == pytest.approx((out[y] >= cutoff).sum() / (out >= cutoff).sum())
    assert q.recall == pytest.approx(((out >= 0) & y).sum() / y.sum())


def test_unreachable_layer_keeps_the_best_trade_off_and_training_goes_on(tmp_path, capsys):
    unpredictable_and_easy_profile(tmp_path / "prof")
    settings = TrainSettings(budget=0.6, batch_size=64, min_epoch_steps=100, epochs=4, extra_epochs=2)
    meta = train_predictors(tmp_path / "prof", tmp_path / "pred", settings, device="cpu")
    noise, easy = meta["layers"]
    assert not noise["target_reached"] and easy["target_reached"] and meta["complete"]
    # Doubling from 8 up to the largest size 60% of the FFN weights allow the first layer (8, 12, 16:
    # 0.6 x 3 x 16 x 32 / (16 + 32) = 19.2 hidden units).
    assert [t["hidden"] for t in noise["tried"]] == [8, 16]
    assert all(t["stopped_early"] for t in noise["tried"])
    assert easy["tried"][0]["hidden"] == 16  # the next layer starts at the largest size tried when none passed
    best = max(noise["tried"], key=lambda t: (t["recall"], t["precision"]))  # none reaches the recall target
    assert noise["hidden"] == best["hidden"] and noise["tuning"]["recall"] == best["recall"] < settings.recall
    lines = capsys.readouterr().err.splitlines()  # stderr is not a terminal here: plain lines
    assert lines[0].startswith("predictors: 6 candidate")
    result_lines = [line for line in lines if line.startswith("layer ")]
    assert len(result_lines) == 2 and all("candidates in" in line and "left" in line for line in result_lines)
    assert result_lines[0].startswith(f"layer 0/2: hidden {best['hidden']},") and "target not reached" in result_lines[0]
    assert "target not reached" not in result_lines[1]
    assert lines[-1].startswith(f"predictors: {sum(len(e['tried']) for e in meta['layers'])} candidate")
    assert "\r" not in "".join(lines)


def test_too_few_pairs_for_the_input_width_warns(tmp_path, capsys):
    unpredictable_and_easy_profile(tmp_path / "few", n=150)  # 16-wide inputs want 160 pairs
    brief = TrainSettings(budget=1.0, batch_size=64, min_epoch_steps=5, epochs=1, extra_epochs=0, min_precision=0)
    meta = train_predictors(tmp_path / "few", tmp_path / "pred", brief, progress=False)
    assert meta["complete"]  # a warning, not an error
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and "150 training pairs per layer for 16-wide inputs" in warning[0]
    assert "profile at least 160 tokens" in warning[0] and "--pairs-mib" not in warning[0]
    profile = json.loads((tmp_path / "few" / PROFILE_JSON).read_text())
    store = PairStore.open(tmp_path / "few" / PAIRS_DIR, 2)
    capped = predictors.too_few_pairs(tmp_path / "few", {**profile, "tokens": 5000}, store)
    pair_bytes = 2 * (16 * 2 + 4)  # two layers of a float16 input row and 32 packed bits
    assert capped.endswith(f"with --pairs-mib {-(-160 * pair_bytes // 2**20)} or more")
    assert predictors.too_few_pairs(tmp_path / "few", {**profile, "pairs_capacity": 160}, store) is None
