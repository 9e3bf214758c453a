"""pitools profile: firing statistics, training pairs, resuming, the report and the corpus reader."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from cli_checks import invoke
from hf_models import build
from powerinfer_tools.formats.profile_folder import PAIRS_DIR, PairStore, pair_capacity, predictor_input
from powerinfer_tools.formats.profile_report import hot_fraction
from safetensors.numpy import load_file
from tiny_models import OPT, TINY_RELU_LLAMA, build_tiny_model, run_profiler

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.checkpoints.tokenizer import CheckpointTokenizer
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.models import load_model
from powerinfer_tools.predictors.trainer import TrainSettings, train_predictors
from powerinfer_tools.profiling.corpus import CorpusSource, read_tokens, resolve_source
from powerinfer_tools.profiling.profiler import (PairSampler, Profiler, ProfileSettings, WindowJob, record_layers,
                                                record_window, windows_of)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-relu"))


def brute_force(model, windows):
    """Per layer: firing counts, absolute sums and every token's (input, fired) by hooking each window."""
    traces = []
    model.ffn_hook = traces.append
    for w in windows:
        model.forward(w, model.new_cache())
    model.ffn_hook = None
    n_layers = model.spec.n_layers
    per_layer = [[t for t in traces if t.layer == i] for i in range(n_layers)]
    fire = np.stack([sum(t.fired.sum(0) for t in ts) for ts in per_layer])
    abs_sum = np.stack([sum(np.abs(t.activated).sum(0, dtype=np.float64) for t in ts) for ts in per_layer])
    x = [np.concatenate([t.residual for t in ts]) for ts in per_layer]
    fired = [np.concatenate([t.fired for t in ts]) for ts in per_layer]
    return fire, abs_sum, x, fired


def test_stats_and_pairs_match_brute_force(tiny, tmp_path):
    model = load_model(Checkpoint(tiny))
    tokens = np.random.default_rng(1).integers(0, 256, 4000)
    stats = run_profiler(model, tokens, tmp_path, pairs_mib=1)
    windows = windows_of(tokens, 128)
    fire, abs_sum, x, fired = brute_force(model, windows)
    assert stats.tokens == 4000
    np.testing.assert_array_equal(stats.fire_count, fire)
    np.testing.assert_allclose(stats.abs_sum, abs_sum, rtol=1e-12)
    assert 0.2 < fire.sum() / (4000 * 2 * 160) < 0.8  # a random ReGLU layer fires about half the time

    # 1 MiB holds fewer pairs than tokens: rows are the sampler's choice, in window order.
    capacity = pair_capacity(4000, 2, 64, 160, pairs_mib=1)
    assert capacity < 4000
    sampler = PairSampler(capacity, 4000, seed=0)
    kept = np.concatenate([128 * w + sampler.rows(w, 128 * w, len(win)) for w, win in enumerate(windows)])
    assert len(kept) == capacity and len(np.unique(kept)) == capacity
    store = PairStore.open(tmp_path / PAIRS_DIR, 2)
    for layer in range(2):
        np.testing.assert_array_equal(store.x[layer], predictor_input(x[layer][kept]).astype(np.float16))
        np.testing.assert_array_equal(np.unpackbits(store.fired[layer], axis=1, count=160).astype(bool),
                                      fired[layer][kept])


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_ranges_of_layers_each_loaded_alone_record_what_the_whole_model_records(tmp_path, family):
    """What ``--layer-ranges`` runs on the cluster: models of a range of layers each (the others not read),
    the residual stream passed from one to the next, their recordings merged: the whole model's window."""
    overrides = {**(TINY_RELU_LLAMA if family == "llama" else OPT), "num_hidden_layers": 5}
    build(tmp_path, family, config_overrides=overrides)
    tokens = np.random.default_rng(4).integers(0, 80, 40)
    job = WindowJob(index=0, start=0, tokens=tokens, rows=np.array([3, 17, 39]))
    whole = record_window(load_model(Checkpoint(tmp_path)), job)
    merged, stream = None, None
    for layers in (range(0, 2), range(2, 3), range(3, 5)):
        part_model = load_model(Checkpoint(tmp_path), layers=layers)
        assert [b is not None for b in part_model.blocks] == [i in layers for i in range(5)]
        part, stream = record_layers(part_model, job, layers, stream)
        assert sorted(part.fire_count) == list(layers)
        if merged is None:
            merged = part
        else:
            merged.add(part)
    assert sorted(merged.fire_count) == sorted(whole.fire_count) == list(range(5))
    for layer in range(5):
        np.testing.assert_array_equal(merged.fire_count[layer], whole.fire_count[layer])
        np.testing.assert_array_equal(merged.abs_sum[layer], whole.abs_sum[layer])
        for mine, theirs in zip(merged.pairs[layer], whole.pairs[layer]):  # (inputs, fired)
            np.testing.assert_array_equal(mine, theirs)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_predictor_input_is_the_residual_before_the_ffn_norm(tmp_path, family):
    """PowerInfer feeds its predictors ``ffn_inp``: ours must be that, up to a positive factor per token."""
    torch_model = build(tmp_path, family, config_overrides=TINY_RELU_LLAMA if family == "llama" else OPT)
    tokens = np.random.default_rng(3).integers(0, 80, 20)
    residuals = {}
    if family == "llama":
        layers, ffn_norm = torch_model.model.layers, "post_attention_layernorm"
    else:
        layers, ffn_norm = torch_model.model.decoder.layers, "final_layer_norm"
    for i, layer in enumerate(layers):
        getattr(layer, ffn_norm).register_forward_hook(
            lambda module, args, out, i=i: residuals.__setitem__(i, args[0].reshape(-1, args[0].shape[-1]).double().numpy()))
    with torch.no_grad():
        torch_model(torch.tensor(tokens[None]), use_cache=False)
    model = load_model(Checkpoint(tmp_path))
    traces = []
    model.ffn_hook = traces.append
    model.forward(tokens, model.new_cache())
    for trace in traces:
        expected = residuals[trace.layer]
        np.testing.assert_allclose(trace.residual, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
        scaled = predictor_input(trace.residual)
        np.testing.assert_allclose(np.sqrt(np.mean(scaled.astype(np.float64) ** 2, axis=1)), 1.0, rtol=1e-5)
        # float32 data: tolerances relative to the largest element, as for the residual above
        rescaled = expected * np.linalg.norm(scaled, axis=1, keepdims=True)
        np.testing.assert_allclose(scaled * np.linalg.norm(expected, axis=1, keepdims=True), rescaled, rtol=1e-3,
                                   atol=1e-6 * np.abs(rescaled).max())


def test_layernorm_models_get_training_pairs_and_predictors(tmp_path):
    build(tmp_path, "opt", config_overrides=OPT)
    model = load_model(Checkpoint(tmp_path))
    stats = run_profiler(model, np.arange(600) % 90, tmp_path / "prof")
    assert stats.fire_count.sum() > 0
    assert json.loads((tmp_path / "prof" / "profile.json").read_text())["pairs_capacity"] == 600
    fast = TrainSettings(epochs=1, min_epoch_steps=10, batch_size=64, min_precision=0.0, budget=0.5)
    meta = train_predictors(tmp_path / "prof", tmp_path / "pred", fast, device="cpu", progress=False)
    assert meta["complete"] and len(meta["layers"]) == 2


def test_stats_file_is_plain_safetensors(tiny, tmp_path):
    model = load_model(Checkpoint(tiny))
    stats = run_profiler(model, np.arange(300) % 256, tmp_path)
    tensors = load_file(tmp_path / "stats.safetensors")
    assert sorted(tensors) == ["blk.0.abs_sum", "blk.0.fire_count", "blk.1.abs_sum", "blk.1.fire_count", "tokens"]
    assert tensors["blk.1.fire_count"].dtype == np.int64 and tensors["blk.1.abs_sum"].dtype == np.float64
    assert int(tensors["tokens"]) == 300
    np.testing.assert_array_equal(tensors["blk.1.fire_count"], stats.fire_count[1])


def test_interrupted_profile_resumes_where_it_stopped(tiny, tmp_path):
    model = load_model(Checkpoint(tiny))
    tokens = np.random.default_rng(2).integers(0, 256, 2000)
    n_windows = len(windows_of(tokens, 128))
    reference = run_profiler(model, tokens, tmp_path / "whole")

    calls = []
    forward = model.forward

    def interrupted_forward(window, cache):
        calls.append(len(window))
        if len(calls) == 6:
            raise KeyboardInterrupt
        return forward(window, cache)

    model.forward = interrupted_forward
    with pytest.raises(KeyboardInterrupt):
        run_profiler(model, tokens, tmp_path / "cut")
    progress = json.loads((tmp_path / "cut" / "profile.json").read_text())["progress"]
    assert progress == {"windows_done": 5, "windows": n_windows, "tokens_done": 640, "pairs": 640, "complete": False}

    calls.clear()
    model.forward = lambda window, cache: calls.append(len(window)) or forward(window, cache)
    resumed = run_profiler(model, tokens, tmp_path / "cut")
    assert len(calls) == n_windows - 5  # only the windows not yet profiled
    np.testing.assert_array_equal(resumed.fire_count, reference.fire_count)
    np.testing.assert_allclose(resumed.abs_sum, reference.abs_sum, rtol=1e-12)
    for name in ("blk.1.x.npy", "blk.1.fired.npy"):
        cut, whole = tmp_path / "cut" / PAIRS_DIR / name, tmp_path / "whole" / PAIRS_DIR / name
        assert cut.read_bytes() == whole.read_bytes()

    calls.clear()
    run_profiler(model, tokens, tmp_path / "cut")
    assert calls == []  # a finished profile is not redone


def test_other_settings_are_refused_unless_forced(tiny, tmp_path):
    model = load_model(Checkpoint(tiny))
    tokens = np.arange(300) % 256
    run_profiler(model, tokens, tmp_path)
    with pytest.raises(PitoolsError, match="seq_len: 128 there, 64 now"):
        run_profiler(model, tokens, tmp_path, seq_len=64)
    with pytest.raises(PitoolsError, match="corpus text differs"):
        run_profiler(model, (tokens + 1) % 256, tmp_path)
    settings = ProfileSettings(seq_len=64, checkpoint_seconds=0)
    stats = Profiler(model, "tiny", tokens, ["test"], tmp_path, settings).run(force=True, progress=False)
    assert stats.tokens == 300
    assert json.loads((tmp_path / "profile.json").read_text())["seq_len"] == 64


def test_dense_swiglu_model_is_refused(tmp_path):
    build(tmp_path, "llama", config_overrides=dict(TINY_RELU_LLAMA, hidden_act="silu"))
    model = load_model(Checkpoint(tmp_path))
    with pytest.raises(PitoolsError, match="swiglu, which is dense"):
        Profiler(model, "silu", np.arange(10), ["t"], tmp_path / "p", ProfileSettings(seq_len=8))


def test_hot_fraction():
    assert hot_fraction(np.full(100, 7)) == 0.8  # uniform: 80% of the neurons carry 80%
    assert hot_fraction(np.array([100] + [0] * 99)) == 0.01
    assert hot_fraction(np.array([50, 30, 10, 10])) == 0.5  # 50 + 30 reach 80 exactly
    assert hot_fraction(np.array([50, 29, 11, 10])) == 0.75
    assert hot_fraction(np.zeros(8)) == 0.0


def test_cli_profile_report_plot_and_export(tiny, tmp_path):
    out = tmp_path / "prof"
    result = invoke("profile", str(tiny), "--tokens", "600", "--seq-len", "100", "-o", str(out), "-q")
    assert result.exit_code == 0, result.stderr
    assert "neurons carrying 80% of firings" in result.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["tokens"] == 600 and len(report["layers"]) == 2
    stats = load_file(out / "stats.safetensors")
    fire = stats["blk.0.fire_count"]
    assert report["layers"][0]["density"] == pytest.approx(fire.sum() / (600 * 160))
    assert report["layers"][0]["hot80_fraction"] == hot_fraction(fire)
    all_fire = np.concatenate([stats["blk.0.fire_count"], stats["blk.1.fire_count"]])
    assert report["model"]["hot80_fraction"] == hot_fraction(all_fire)
    assert (out / "firing_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    meta = json.loads((out / "profile.json").read_text())
    assert meta["corpus"] == [str(tiny / "heldout.txt")] and meta["progress"]["complete"]

    again = invoke("profile", "--report", str(out), "--json", "--export-powerinfer", str(tmp_path / "activation"))
    assert again.exit_code == 0, again.stderr
    assert json.loads(again.stdout)["layers"] == report["layers"]
    torch = pytest.importorskip("torch")
    exported = torch.load(tmp_path / "activation" / "activation_1.pt")
    assert exported.dtype == torch.int64
    np.testing.assert_array_equal(exported.numpy(), stats["blk.1.fire_count"])


def test_cli_errors_are_one_line(tiny, tmp_path):
    result = invoke("profile", str(tiny), "-q")
    assert result.exit_code == 1 and "give -o DIR" in result.stderr
    result = invoke("profile", str(tiny), "--seq-len", "4096", "-o", str(tmp_path / "p"), "-q")
    assert result.exit_code == 1 and "exceeds the model's context length 128" in result.stderr
    result = invoke("profile", str(tiny), "--corpus", str(tmp_path / "missing.txt"), "-o", str(tmp_path / "p"))
    assert result.exit_code == 1 and "no such corpus file" in result.stderr


def test_cli_interrupt_says_how_to_resume(tiny, tmp_path, monkeypatch):
    def interrupted(self, force, progress, windows):
        raise KeyboardInterrupt

    monkeypatch.setattr(Profiler, "run", interrupted)
    result = invoke("profile", str(tiny), "--tokens", "100", "-o", str(tmp_path), "-q")
    assert result.exit_code == 130  # interrupted, as for every command: 128 + SIGINT
    assert result.stderr.count("\n") == 1
    assert f"pitools: error: interrupted; run the same command again to resume from the last checkpoint in {tmp_path}" in result.stderr


# --- corpus ----------------------------------------------------------------------------------------


def test_corpus_text_and_jsonl_files(tiny, tmp_path):
    tokenizer = CheckpointTokenizer(tiny)
    (tmp_path / "a.txt").write_text("abc", encoding="utf-8")
    (tmp_path / "b.jsonl").write_text('{"text": "de"}\n\n"fgh"\n{"body": "x", "text": "ij"}\n', encoding="utf-8")
    source = CorpusSource((tmp_path / "a.txt", tmp_path / "b.jsonl"))
    everything = read_tokens(source, tokenizer, 100)
    assert tokenizer.decode(everything.tolist()) == "abcdefghij"
    assert tokenizer.decode(read_tokens(source, tokenizer, 4, skip_tokens=2).tolist()) == "cdef"

    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": 1}\n', encoding="utf-8")
    with pytest.raises(PitoolsError, match=r"bad.jsonl:2: expected a string or an object with a string 'text'"):
        read_tokens(CorpusSource((tmp_path / "bad.jsonl",)), tokenizer, 100)
    with pytest.raises(PitoolsError, match="has 3 tokens; at least 5 are needed"):
        read_tokens(CorpusSource((tmp_path / "a.txt",)), tokenizer, 10, skip_tokens=3)


def test_corpus_defaults_to_heldout_text_and_dataset_needs_datasets(tiny, tmp_path, monkeypatch):
    assert resolve_source((), None, tiny).files == (tiny / "heldout.txt",)
    with pytest.raises(PitoolsError, match="no heldout.txt to default to"):
        resolve_source((), None, tmp_path)
    with pytest.raises(PitoolsError, match="either --corpus files or --dataset"):
        resolve_source((tmp_path / "a.txt",), "wikitext", tiny)
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # as if it were not installed
    with pytest.raises(PitoolsError, match="needs the optional `datasets` package"):
        read_tokens(resolve_source((), "wikitext:wikitext-2-raw-v1", tiny), CheckpointTokenizer(tiny), 10)
