"""pitools train-predictors: gradients, the hidden-size ladder under a budget, the folder format, resuming."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_checks import invoke
from powerinfer_tools.formats.predictor_folder import predict, predictor_report
from powerinfer_tools.formats.profile_folder import FORMAT as PROFILE_FORMAT
from powerinfer_tools.formats.profile_folder import PAIRS_DIR, PROFILE_JSON, STATS_FILE, FiringStats, PairStore
from safetensors.numpy import load_file
from tiny_models import run_profiler

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.fileio import write_json
from powerinfer_tools.models import load_model
from powerinfer_tools.predictors import trainer as predictors
from powerinfer_tools.predictors.trainer import TrainSettings, gradients, hidden_ladder, train_predictors

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
    np.testing.assert_array_equal(predict(np, fc1, fc2, x), [[True, False, True], [True, True, True]])
    np.testing.assert_array_equal(predict(np, fc1, fc2, x, threshold=0.5), [[True, False, False], [False] * 3])


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
        # Recompute the recorded quality from the saved weights on the held-out (last) pairs.
        x = store.x[entry["layer"]][-n_val:].astype(np.float32)
        fired = np.unpackbits(store.fired[entry["layer"]][-n_val:], axis=1, count=160).astype(bool)
        pred = predict(np, fc1, fc2, x)
        assert entry["recall"] == pytest.approx((pred & fired).sum() / fired.sum(), abs=1e-6)
        assert entry["precision"] == pytest.approx((pred & fired).sum() / pred.sum(), abs=1e-6)
        assert entry["recall"] >= FAST.recall
        # The ladder's choice: the first size passing both targets, else the most precise at the recall target.
        reaching = [t for t in entry["tried"] if t["recall"] >= FAST.recall]
        passing = [t for t in reaching if t["precision"] >= FAST.min_precision]
        if passing:
            assert entry["hidden"] == passing[0]["hidden"] and entry["tried"][-1] == passing[0]
        else:
            assert entry["precision"] == max(t["precision"] for t in reaching)
        params += fc1.size + fc2.size
    assert params <= FAST.budget * saved["ffn_params"] == FAST.budget * 2 * 3 * 64 * 160
    report = predictor_report(saved)
    assert report["all_layers_reach_recall"] and report["total_bytes"] == 4 * params


def write_synthetic_profile(folder, x, fired_per_layer):
    """A profile folder (layout of formats/README.md) holding the given pairs for each layer."""
    n, d_model = x.shape
    d_ff = fired_per_layer[0].shape[1]
    store = PairStore.create(folder / PAIRS_DIR, len(fired_per_layer), d_model, d_ff, n)
    for layer, fired in enumerate(fired_per_layer):
        store.write(layer, 0, x, fired)
    store.flush()
    fire = np.stack([f.sum(0) for f in fired_per_layer]).astype(np.int64)
    FiringStats(fire, fire.astype(np.float64), n).save(folder / STATS_FILE, {})
    write_json(folder / PROFILE_JSON, {
        "model": "synthetic", "format": PROFILE_FORMAT, "architecture": "llama", "ffn": "reglu",
        "n_layers": len(fired_per_layer), "d_model": d_model, "d_ff": d_ff, "corpus_sha256": "0", "tokens": n,
        "pairs_capacity": n, "progress": {"complete": True},
    })


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
    assert all(e["recall"] >= 0.95 and e["precision"] >= 0.5 for e in meta["layers"])


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
    assert "every layer at the recall target: yes" in result.stdout
    report = invoke("train-predictors", "--report", str(tmp_path), "--json")
    assert report.exit_code == 0, report.stderr
    layers = json.loads(report.stdout)["layers"]
    assert [e["layer"] for e in layers] == [0, 1] and all(e["recall"] >= 0.95 for e in layers)
    unfinished = invoke("train-predictors", str(profile_dir), "-q")
    assert unfinished.exit_code == 1 and "give a profile DIR and -o PRED" in unfinished.stderr
