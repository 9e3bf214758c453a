"""Synthetic benchmark models: planted firing frequencies, the construction's premise, and the files written."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from cli_checks import fails
from click.testing import CliRunner
from gguf_fixtures import FAST_TRAINING, llama
from powerinfer_tools.formats.activation_thresholds import SparsityRule, read_thresholds
from powerinfer_tools.formats.model_file import open_model_file
from powerinfer_tools.formats.profile_folder import pair_capacity
from powerinfer_tools.formats.profile_report import hot_fraction
from powerinfer_tools.solver.model_stats import read_model_stats

from powerinfer_tools.benchmarking import synth as synth_module
from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.benchmarking.synth import (
    HARDNESS,
    P_MAX,
    REAL_MODEL_COMPUTED,
    ROUTING_SKEW,
    SHAPES,
    Geometry,
    PlantedActivations,
    Planting,
    Shape,
    SiluSettings,
    activation_statistics,
    default_profile_tokens,
    dense_companion,
    firing_frequencies,
    ideal_selection,
    moments,
    planted_frequencies,
    planted_routing,
    synthesize,
    synthesize_silu,
    write_checkpoint,
    write_silu_checkpoint,
)
from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.commands.cli import cli
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.models import load_model
from powerinfer_tools.models.layers import route
from powerinfer_tools.profiling.profiler import ProfileSettings


def test_frequencies_have_the_planted_mean_and_a_power_law_skew():
    p = firing_frequencies(5632, 0.1, np.random.default_rng(0))
    assert p.mean() == pytest.approx(0.1, rel=1e-6)
    assert p.max() <= P_MAX and p.min() > 0
    # A minority of neurons carries 80% of the firings, as in real ReLU models' profiles.
    assert 0.25 < hot_fraction(p) < 0.5
    assert np.array_equal(p, firing_frequencies(5632, 0.1, np.random.default_rng(0)))


def test_gate_rows_fire_with_their_planted_probabilities():
    rng = np.random.default_rng(1)
    geometry = Geometry.random(512, 4, rng)
    x = geometry.embeddings(4000, rng)
    np.testing.assert_allclose(np.sqrt((x * x).mean(axis=1)), 1.0, rtol=1e-9)  # RMS 1: the norm keeps x
    p = firing_frequencies(256, 0.1, rng)
    fired = x @ geometry.gate(p, 0.15, rng).T > 0
    assert fired.mean() == pytest.approx(0.1, abs=0.01)
    assert np.corrcoef(fired.mean(axis=0), p)[0, 1] > 0.99


@pytest.mark.parametrize("noise", [0.15, 0.35])
def test_the_ideal_selection_is_what_a_predictor_seeing_the_latent_space_achieves(noise):
    """The model's stated predictability, checked on the construction itself: rank (token, neuron)
    pairs by the gate's pre-activation projected onto the mean and latent directions (what a
    predictor of 2(rank+1) units can compute exactly), and count what 95% recall costs."""
    rng = np.random.default_rng(2)
    geometry = Geometry.random(512, 8, rng)
    p = firing_frequencies(1024, 0.1, np.random.default_rng([0, 2, 0]))
    gate = geometry.gate(p, noise, rng)
    x = geometry.embeddings(2000, rng)
    fires = (x @ gate.T > 0).ravel()
    seen = np.column_stack([geometry.mean, geometry.latent])
    visible = ((x @ seen) @ (seen.T @ gate.T)).ravel()
    found = np.cumsum(fires[np.argsort(-visible)])
    computed = (np.searchsorted(found, 0.95 * found[-1]) + 1) / fires.size
    shape = dataclasses.replace(SHAPES["test-tiny"], d_model=512, d_ff=1024)
    ideal = ideal_selection(Planting(density=0.1, rank=8, noise=noise), shape, tokens=1000)
    assert ideal["computed"] == pytest.approx(computed, rel=0.05)
    assert ideal["precision"] == pytest.approx(0.95 * fires.mean() / computed, rel=0.05)


def test_harder_levels_need_larger_predictors_and_compute_more():
    shape = SHAPES["tinyllama-1.1b"]
    plantings = [HARDNESS[level].planting(shape, 0.1, 0) for level in ("easy", "medium", "hard")]
    assert [p.rank for p in plantings] == [4, 32, 128]
    computed = [ideal_selection(p, shape)["computed"] for p in plantings]
    assert 0.095 < computed[0] < computed[1] < computed[2] < 0.2


@pytest.mark.parametrize("shape", ["tinyllama-1.1b", "llama-7b"])
def test_the_realistic_level_is_at_least_as_hard_as_the_real_model_measured(shape):
    # Even an ideal predictor of the latent space computes at least what trained ones did on SmolLM2 at 95% recall.
    ideal = ideal_selection(HARDNESS["realistic"].planting(SHAPES[shape], 0.1, 0), SHAPES[shape])
    assert ideal["computed"] >= REAL_MODEL_COMPUTED and ideal["precision"] > HARDNESS["realistic"].min_precision


def test_router_rows_route_with_the_planted_shares_and_leave_experts_firing_as_planted():
    """Routing reads the token's random part only: the tokens routed to an expert fire its gate rows
    with their planted probabilities, and each expert gets the share ``planted_routing`` states."""
    shape = Shape(512, 256, 1, 4, 2, n_experts=8, n_experts_used=2)
    rng = np.random.default_rng(3)
    geometry = Geometry.random(shape.d_model, 4, rng)
    bias, share = planted_routing(shape, Planting(rank=4), 0)
    x = geometry.embeddings(8000, rng)
    experts, _ = route(x @ geometry.router(bias, rng).T, shape.n_experts_used)
    realised = np.bincount(experts.ravel(), minlength=shape.n_experts) / len(x)
    np.testing.assert_allclose(realised, share, atol=0.015)
    p = firing_frequencies(256, 0.1, rng)
    busiest = (experts == np.argmax(share)).any(axis=1)
    fired = x[busiest] @ geometry.gate(p, 0.15, rng).T > 0
    assert fired.mean() == pytest.approx(0.1, abs=0.01)
    assert np.corrcoef(fired.mean(axis=0), p)[0, 1] > 0.98


@pytest.mark.parametrize("skew", [0.0, ROUTING_SKEW, 1.0])
def test_routing_shares_follow_a_zipf_law_over_experts(skew):
    shape = SHAPES["mixtral-8x7b"]
    _, share = planted_routing(shape, Planting(routing_skew=skew), 0)
    assert share.sum() == pytest.approx(2)  # every token to 2 experts
    zipf = np.arange(1, 9) ** -skew
    np.testing.assert_allclose(np.sort(share)[::-1], 2 * zipf / zipf.sum(), atol=0.005)
    if skew == ROUTING_SKEW:  # mildly skewed, as Mixtral's routing is: no expert starved
        assert 1.7 < share.max() / share.min() < 2.1 and share.min() > 0.15
    assert not np.array_equal(share, planted_routing(shape, Planting(routing_skew=skew), 1)[1])  # own order per layer


@pytest.fixture(scope="module", params=["test-tiny", "test-tiny-moe"])
def checkpoint(request, tmp_path_factory):
    shape = SHAPES[request.param]
    folder = tmp_path_factory.mktemp("synth") / "checkpoint"
    frequencies = write_checkpoint(folder, shape, Planting(density=0.1))
    return Checkpoint(folder), shape, frequencies


def recorded_firing(shape, n_tokens):
    """An FFN hook and what it records per layer: which neurons of which FFN (a mixture's experts side by
    side, as the profiler lays them out) fired on which token, and which FFNs ran on which token."""
    ffns = max(shape.n_experts, 1)
    fired = np.zeros((shape.n_layers, n_tokens, ffns, shape.d_ff), bool)
    ran = np.zeros((shape.n_layers, n_tokens, ffns), bool)

    def hook(trace):
        tokens = np.arange(n_tokens) if trace.tokens is None else trace.tokens
        assert np.all(np.diff(tokens) > 0) and (trace.expert is None) == (shape.n_experts == 0)
        fired[trace.layer, tokens, trace.expert or 0] = trace.fired
        ran[trace.layer, tokens, trace.expert or 0] = True

    return hook, fired, ran


def test_planted_activations_match_the_reference_engine(checkpoint):
    """The profile comes from the construction, not forward passes: its premise is that attention and FFN
    outputs barely move the residual stream, so every FFN sees the token's normalised embedding, and a
    mixture's router sends it to the same experts."""
    ckpt, shape, frequencies = checkpoint
    units = shape.n_layers * max(shape.n_experts, 1)
    assert frequencies.shape == (units, 256) and frequencies.mean() == pytest.approx(0.1)
    assert np.array_equal(frequencies, planted_frequencies(shape, Planting(density=0.1)))  # what a resume reports
    tokens = np.random.default_rng(2).integers(0, 4096, 200)
    engine, planted = load_model(ckpt), PlantedActivations(ckpt)
    engine.ffn_hook, engine_fired, engine_ran = recorded_firing(shape, len(tokens))
    engine.forward(tokens, engine.new_cache())
    planted.ffn_hook, planted_fired, planted_ran = recorded_firing(shape, len(tokens))
    planted.forward(tokens)
    assert np.all(planted_ran.sum(axis=2) == max(shape.n_experts_used, 1))
    for layer in range(shape.n_layers):
        assert (engine_ran[layer] == planted_ran[layer]).mean() > 0.98  # routing decisions (all True: dense)
        both = engine_ran[layer] & planted_ran[layer]
        agreement = (engine_fired[layer][both] == planted_fired[layer][both]).mean()
        assert agreement > 0.99, (layer, agreement)
        assert planted_fired[layer][planted_ran[layer]].mean() == pytest.approx(0.1, abs=0.02)


def test_synthesize_writes_a_powerinfer_file_with_predictors_and_a_dense_twin(synthesized_tiny):
    assert synthesized_tiny.dense == synthesized_tiny.powerinfer.with_name("tiny.gguf")
    sparse, dense = open_model_file(synthesized_tiny.powerinfer), open_model_file(synthesized_tiny.dense)
    assert sparse.powerinfer and not dense.powerinfer
    assert "blk.1.fc2.weight" in sparse and "blk.1.ffn_down_t.weight" in sparse
    assert "blk.1.ffn_down.weight" in dense and "blk.0.fc1.weight" not in dense
    # Same weights in both files.
    assert np.array_equal(sparse["blk.0.ffn_gate.weight"].data, dense["blk.0.ffn_gate.weight"].data)
    # The profiled firing frequencies are in the file, so `pitools solve` can place its neurons.
    frequencies = read_model_stats(synthesized_tiny.powerinfer)["freqs"]
    assert len(frequencies) == 2 and np.mean(frequencies) == pytest.approx(0.1, abs=0.02)
    assert not synthesized_tiny.powerinfer.with_name(synthesized_tiny.powerinfer.name + ".work").exists()
    summary = synthesized_tiny.summary()
    assert summary["profiled_density"] == pytest.approx(0.1, abs=0.02)
    assert len(summary["predictor_hidden"]) == 2


@pytest.fixture(scope="module")
def synthesized_tiny_moe(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth-moe") / "moe.powerinfer.gguf"
    return synthesize("test-tiny-moe", out, "q4_0", profile_tokens=800, train=FAST_TRAINING, progress=False)


def test_a_mixture_gets_routing_and_a_predictor_per_expert(synthesized_tiny_moe):
    result, shape = synthesized_tiny_moe, SHAPES["test-tiny-moe"]
    sparse, dense = open_model_file(result.powerinfer), open_model_file(result.dense)
    assert "blk.1.fc1.3.weight" in sparse and "blk.1.ffn_down_t.3.weight" in sparse
    assert "blk.1.ffn_gate_exps.weight" in dense and "blk.1.ffn_gate_inp.weight" in dense
    summary = result.summary()
    assert (summary["experts"], summary["experts_used"]) == (4, 2)
    assert len(summary["predictor_hidden"]) == shape.n_layers * shape.n_experts
    for layer in range(shape.n_layers):
        profiled = np.array(summary["profiled_routing"][layer])
        np.testing.assert_allclose(profiled, sparse.get(f"pitools.blk.{layer}.expert_frequency"), rtol=1e-6)
        np.testing.assert_allclose(profiled, summary["planted_routing"][layer], atol=0.06)  # 800 tokens
        assert profiled.sum() == pytest.approx(2)
    # Each expert fires its planted density on the tokens routed to it.
    np.testing.assert_allclose(summary["profiled_expert_density"], 0.1, atol=0.02)
    assert summary["profiled_density"] == pytest.approx(0.1, abs=0.02)


def test_the_firing_meter_counts_every_routed_experts_neurons(synthesized_tiny_moe):
    """The bench's recall on a mixture (``RuntimeModel.firing_meter``): each token's neurons of the experts
    it is routed to, every one of them computed to see which fire."""
    from powerinfer_tools.interfaces import FFNMode
    from powerinfer_tools.runtime.loader import load_runtime_model
    from powerinfer_tools.runtime.selection_meter import SelectionMeter

    shape, model = SHAPES["test-tiny-moe"], load_runtime_model(synthesized_tiny_moe.powerinfer, use_split=False)
    model.mode, caches = FFNMode.SPARSE, model.new_cache()
    model.firing_meter = meter = SelectionMeter.zeros(shape.n_layers)
    for token in (11, 500, 7, 3000, 42):
        model.forward(np.array([token]), caches, all_logits=False)
    assert (meter.seen == 5 * shape.n_experts_used * shape.d_ff).all()
    assert (0 < meter.hit).all() and (meter.hit <= meter.fired).all() and (meter.hit <= meter.computed).all()


def test_llama_cpp_runs_the_dense_twin_of_a_mixture(synthesized_tiny_moe):
    model = llama(synthesized_tiny_moe.dense, n_ctx=64, n_threads=1)
    model.eval([5, 17, 3])


def test_llama_cpp_runs_the_dense_twin(synthesized_tiny):
    model = llama(synthesized_tiny.dense, n_ctx=64, n_threads=1)
    assert model.n_vocab() == SHAPES["test-tiny"].vocab_size
    model.eval([5, 17, 3])


def test_dense_companion_names():
    from pathlib import Path

    assert dense_companion(Path("/m/x.powerinfer.gguf")) == Path("/m/x.gguf")
    assert dense_companion(Path("/m/x.gguf")) == Path("/m/x.dense.gguf")


def test_refusals(tmp_path, synthesized_tiny):
    with pytest.raises(PitoolsError, match="unknown shape"):
        synthesize("gpt-5", tmp_path / "a.powerinfer.gguf")
    with pytest.raises(PitoolsError, match="density"):
        Planting(density=1.5)
    with pytest.raises(PitoolsError, match="exists"):
        synthesize("test-tiny", synthesized_tiny.powerinfer)


@pytest.mark.parametrize("shape", ["tinyllama-1.1b", "test-tiny"])
def test_profiled_tokens_hold_out_ids_of_their_own(shape):
    """The pairs the trainer holds out are tokens whose ids no training pair has; at a real vocabulary's size
    neither pool has an id the bench's text encodes to (the bundled tokenizer's, which every synth model has)."""
    vocab = SHAPES[shape].vocab_size
    tokens = Planting().profile_tokens(vocab, 20_000, 2_000)
    trained, held_out = set(tokens[:-2_000].tolist()), set(tokens[-2_000:].tolist())
    assert len(tokens) == 20_000 and not trained & held_out and len(held_out) > 500
    text_ids = set(range(json.loads((BUNDLED_MODEL / "config.json").read_text())["vocab_size"]))
    if vocab >= 2 * len(text_ids):
        assert not (trained | held_out) & text_ids
    assert max(trained | held_out) < vocab


@pytest.mark.parametrize("shape", ["tinyllama-1.1b", "llama-7b", "mixtral-8x7b"])
def test_synth_keeps_every_profiled_tokens_training_pairs(shape):
    """Hard models need many pairs per input dimension: a 50,000-token profile keeps all 50,000
    (the profiler's default cap would keep ~10,000 at the TinyLlama shape)."""
    s = SHAPES[shape]
    widths = s.n_layers, s.d_model, s.d_ff
    assert pair_capacity(50_000, *widths, synth_module._pairs_mib(s, 50_000), s.n_experts) == 50_000
    assert pair_capacity(50_000, *widths, ProfileSettings(seq_len=1024).pairs_mib, s.n_experts) < 20_000


def test_mixtral_shape_counts_its_experts():
    assert SHAPES["mixtral-8x7b"].n_params == pytest.approx(46.7e9, rel=0.005)  # Mixtral-8x7B's published size
    # Each of 8 experts sees a quarter of the tokens (2 per token): as many training pairs as a dense layer.
    assert default_profile_tokens(SHAPES["mixtral-8x7b"]) == 4 * default_profile_tokens(SHAPES["llama-7b"]) == 16384


def test_a_shape_with_fewer_layers(tmp_path):
    result = synthesize("test-tiny", tmp_path / "l.powerinfer.gguf", "q8_0", profile_tokens=256, train=FAST_TRAINING,
                        progress=False, layers=1)
    assert result.shape == "test-tiny, 1 layers" and len(result.predictors["layers"]) == 1
    for path in (result.powerinfer, result.dense):
        model = open_model_file(path)
        assert model.get("{arch}.block_count") == 1
        assert model.get("{arch}.embedding_length") == SHAPES["test-tiny"].d_model


def test_cli_prints_a_json_summary(tmp_path, monkeypatch):
    monkeypatch.setattr("powerinfer_tools.benchmarking.synth.SYNTH_TRAINING", FAST_TRAINING)
    result = CliRunner().invoke(cli, ["synth", "--shape", "test-tiny", "-o", str(tmp_path / "t.powerinfer.gguf"),
                                      "--profile-tokens", "800", "--json", "-q"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert {"powerinfer", "dense", "planted_density", "profiled_density", "predictor_hidden"} <= set(summary)


def test_cli_prints_a_mixtures_routing(tmp_path, monkeypatch):
    monkeypatch.setattr("powerinfer_tools.benchmarking.synth.SYNTH_TRAINING", FAST_TRAINING)
    result = CliRunner().invoke(cli, ["synth", "--shape", "test-tiny-moe", "-o", str(tmp_path / "m.powerinfer.gguf"),
                                      "--profile-tokens", "800", "--routing-skew", "0", "-q"])
    assert result.exit_code == 0, result.output
    assert "experts: 4 per layer, 2 per token; tokens routed to an expert: planted 50.0%-50.0%" in result.output


def test_an_interrupted_synthesis_resumes_from_its_work_folder(tmp_path, monkeypatch):
    out = tmp_path / "r.powerinfer.gguf"
    settings = dict(profile_tokens=800, train=FAST_TRAINING, progress=False)
    first = synthesize("test-tiny", out, "q8_0", keep_work=True, **settings)
    made = {p: p.read_bytes() for p in (first.powerinfer, first.dense)}
    for path in made:  # as if stopped after training, before the files were written
        path.unlink()

    def no_rewrite(*args):
        raise AssertionError("the checkpoint was written again")

    monkeypatch.setattr("powerinfer_tools.benchmarking.synth.write_checkpoint", no_rewrite)
    second = synthesize("test-tiny", out, "q8_0", **settings)
    assert {p: p.read_bytes() for p in (second.powerinfer, second.dense)} == made
    assert second.summary() == first.summary()
    assert not (tmp_path / "r.powerinfer.gguf.work").exists()


def test_a_work_folder_of_other_settings_is_refused(tmp_path):
    out = tmp_path / "w.powerinfer.gguf"
    synthesize("test-tiny", out, "q8_0", profile_tokens=800, train=FAST_TRAINING, keep_work=True, progress=False)
    for path in (out, dense_companion(out)):
        path.unlink()
    with pytest.raises(PitoolsError, match="other settings .differs: planting"):
        synthesize("test-tiny", out, "q8_0", Planting(density=0.2), profile_tokens=800, train=FAST_TRAINING,
                   progress=False)


def test_moments_tell_a_gaussian_from_a_laplacian():
    rng = np.random.default_rng(0)
    gaussian, laplacian = moments(rng.standard_normal(400_000)), moments(rng.laplace(1.0, 2.0, 400_000))
    assert gaussian["excess_kurtosis"] == pytest.approx(0, abs=0.05)
    assert gaussian["within_1std"] == pytest.approx(0.683, abs=0.005)
    assert laplacian["mean"] == pytest.approx(1, abs=0.02) and laplacian["std"] == pytest.approx(2 * np.sqrt(2), rel=0.01)
    assert laplacian["excess_kurtosis"] == pytest.approx(3, abs=0.3)
    assert laplacian["within_1std"] == pytest.approx(1 - np.exp(-np.sqrt(2)), abs=0.005)


def test_a_silu_checkpoint_has_swiglu_statistics_and_a_residual_stream_that_grows_slowly(tmp_path):
    """Sane scales without a calibration: over 8 layers the residual stream's RMS grows as the square root
    of the depth (not exponentially), every FFN input is zero-mean and Gaussian-like, the down
    projection's input heavy-tailed. (A mean within 0.2: at d_model 64 the token-independent part of the
    residual stream, attention's average of the context, does not average out over the channels.)"""
    shape = dataclasses.replace(SHAPES["test-tiny"], n_layers=8)
    write_silu_checkpoint(tmp_path, shape, SiluSettings())
    checkpoint = Checkpoint(tmp_path)
    assert checkpoint.config["hidden_act"] == "silu"
    statistics = activation_statistics(load_model(checkpoint), np.random.default_rng(1).integers(0, 4096, 128))
    assert statistics["tokens"] == 128 and len(statistics["layers"]) == 8
    rms = [layer["residual_rms"] for layer in statistics["layers"]]
    assert 0.9 < rms[0] < 1.3 and rms[-1] < 3 * rms[0]
    for layer in statistics["layers"]:
        x, gate, down = layer["ffn_input"], layer["abs_silu_gate"], layer["down_input"]
        assert abs(x["mean"]) < 0.2 and x["std"] == pytest.approx(1, abs=0.05)
        assert abs(x["excess_kurtosis"]) < 1.5 and 0.6 < x["within_1std"] < 0.8
        assert gate["mean"] > 0 and down["excess_kurtosis"] > 3 > x["excess_kurtosis"]


@pytest.fixture(scope="module")
def synthesized_silu(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth-silu") / "silu.powerinfer.gguf"
    return synthesize_silu("test-tiny", out, "q8_0", SiluSettings(target_sparsity=0.5), calibration_tokens=512,
                           progress=False)


def test_a_silu_model_carries_calibrated_thresholds_and_a_dense_twin(synthesized_silu):
    result, shape = synthesized_silu, SHAPES["test-tiny"]
    assert result.dense == result.powerinfer.with_name("silu.gguf")
    sparse, dense = open_model_file(result.powerinfer), open_model_file(result.dense)
    assert sparse.powerinfer and not dense.powerinfer
    assert "blk.1.ffn_down_t.weight" in sparse and "blk.1.fc1.weight" not in sparse  # thresholds, no predictors
    assert np.array_equal(sparse["blk.0.ffn_gate.weight"].data, dense["blk.0.ffn_gate.weight"].data)
    thresholds = read_thresholds(sparse.get, shape.n_layers, str(result.powerinfer))
    assert thresholds.rule is SparsityRule.CATS and thresholds.target == pytest.approx(0.5)
    assert all(layer.cats > 0 for layer in thresholds.layers)
    assert not result.powerinfer.with_name(result.powerinfer.name + ".work").exists()


def test_a_silu_models_summary_states_its_activation_statistics(synthesized_silu):
    summary = json.loads(json.dumps(synthesized_silu.summary()))
    assert (summary["activation"], summary["rule"], summary["target_sparsity"]) == ("silu", "cats", 0.5)
    assert summary["calibration_tokens"] == 512 and summary["outlier_channels"] == 1
    assert summary["calibrated_density"] == pytest.approx(0.5, abs=0.02)  # CATS: half the neurons read per token
    statistics = summary["statistics"]
    assert len(statistics["layers"]) == SHAPES["test-tiny"].n_layers
    for values in [statistics["mean_over_layers"], *statistics["layers"]]:
        x, gate, down = values["ffn_input"], values["abs_silu_gate"], values["down_input"]
        assert abs(x["mean"]) < 0.2 and 0.6 < x["within_1std"] < 0.8  # Gaussian-like
        assert gate["mean"] > 0 and gate["std"] > 0
        assert abs(down["mean"]) < 0.1 and down["excess_kurtosis"] > 0  # heavy-tailed
        assert down["within_1std"] > x["within_1std"]


def test_cli_writes_a_silu_model_with_the_rule_asked_for(tmp_path):
    out = tmp_path / "t.powerinfer.gguf"
    result = CliRunner().invoke(cli, ["synth", "--shape", "test-tiny", "--activation", "silu", "--target-sparsity",
                                      "0.4", "--sparsity-rule", "teal", "--profile-tokens", "256", "-o", str(out),
                                      "--json", "-q"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert (summary["rule"], summary["target_sparsity"], summary["calibration_tokens"]) == ("teal", 0.4, 256)
    thresholds = read_thresholds(open_model_file(out).get, 2, str(out))
    assert thresholds.rule is SparsityRule.TEAL and all(layer.ffn_in > 0 for layer in thresholds.layers)
    assert dense_companion(out).is_file()


@pytest.mark.parametrize("options, match", [
    (["--activation", "silu", "--density", "0.2"], "--density: only for --activation relu"),
    (["--activation", "silu", "--hardness", "easy", "--rank", "8"], "--hardness, --rank: only for --activation relu"),
    (["--target-sparsity", "0.5"], "--target-sparsity: only for --activation silu"),
    (["--activation", "relu", "--sparsity-rule", "cats"], "--sparsity-rule: only for --activation silu"),
    (["--activation", "silu", "--ray"], "--ray: only for --activation relu"),  # no predictors to train
])
def test_cli_refuses_options_of_the_other_activation(tmp_path, options, match):
    out = tmp_path / "x.powerinfer.gguf"
    fails("synth", "--shape", "test-tiny", *options, "-o", out, match=match)
    assert not list(tmp_path.iterdir())


def test_a_silu_mixture_is_refused(tmp_path):
    out = tmp_path / "x.powerinfer.gguf"
    fails("synth", "--shape", "test-tiny-moe", "--activation", "silu", "-o", out, match="mixture of experts")
    assert not list(tmp_path.iterdir())
    with pytest.raises(PitoolsError, match="target-sparsity"):
        SiluSettings(target_sparsity=1.0)
