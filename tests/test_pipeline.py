"""The whole pipeline on a small random ReLU LLaMA: convert (profile, train predictors, reorder
hot-first, write frequencies), then `pitools run --vram`, which solves a split on the fly."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from gguf_fixtures import FAST_TRAINING, TOKENS, make_model, relative_error, stepwise_logits, write_code_corpus
from powerinfer_tools.formats.constants import neuron_frequency_key
from powerinfer_tools.formats.gpu_split import GpuSplit, default_split_path, read_gpu_split, write_gpu_split
from powerinfer_tools.formats.model_file import open_model_file

from powerinfer_tools import kernels
from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.commands.cli import cli
from powerinfer_tools.conversion.convert import convert
from powerinfer_tools.conversion.sparsify import SparsifySettings
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.models import load_model
from powerinfer_tools.runtime.llm import LLM
from powerinfer_tools.runtime.loader import load_runtime_model

MODELS = {
    "llama": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, hidden_act="relu"),
    "opt": dict(hidden_size=64, ffn_dim=256, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
                word_embed_proj_dim=64, pad_token_id=1),
}
N_LAYERS, D_FF = 2, 256


@pytest.fixture(scope="module", params=sorted(MODELS))
def pipeline(request, tmp_path_factory):
    """(checkpoint folder, converted PowerInfer f32 file)."""
    root = tmp_path_factory.mktemp(f"pipeline-{request.param}")
    folder = root / "model"
    make_model(folder, request.param, **MODELS[request.param])
    corpus = write_code_corpus(root / "corpus.txt")
    settings = SparsifySettings(corpus=(corpus,), tokens=1024, seq_len=128, train=FAST_TRAINING)
    path, _ = convert(str(folder), root / "m.powerinfer.gguf", "f32", sparsify=settings, progress=False)
    return folder, path


def test_convert_profiles_trains_and_orders_neurons_hot_first(pipeline):
    folder, path = pipeline
    model = open_model_file(path)
    for layer in range(N_LAYERS):
        assert f"blk.{layer}.fc1.weight" in model and f"blk.{layer}.ffn_down_t.weight" in model
        freq = np.asarray(model.get(neuron_frequency_key(layer)))
        assert freq.shape == (D_FF,)
        assert np.all(np.diff(freq) <= 0) and 0 < freq.mean() < 1  # hot first, and a real profile
    assert (path.parent / (path.name + ".work") / "predictors" / "predictors.json").is_file()
    # Reordering neurons changes nothing: the runtime's dense result is the checkpoint's.
    engine = load_model(Checkpoint(folder), np.float64)
    reference = engine.forward(TOKENS, engine.new_cache())
    assert relative_error(stepwise_logits(load_runtime_model(path)), reference) < 1e-4


def test_vram_budget_solves_a_split_caches_it_and_changes_nothing(pipeline):
    _, path = pipeline
    split = default_split_path(path)
    split.unlink(missing_ok=True)
    expected = stepwise_logits(load_runtime_model(path))
    # Part of the model: the budget also holds each GPU layer's KV cache for 2048 tokens, which in
    # these tiny models outweighs the layer.
    budget = int(1.5 * path.stat().st_size)

    first = LLM.load(path, mode="dense", device="emulated", vram=budget)
    assert "solved now" in first.description and split.is_file()
    solved = read_gpu_split(split)
    assert solved.extra["pitools.vram_budget"] == budget and any(m.any() for m in solved.masks)
    assert relative_error(stepwise_logits(first.engine), expected) < 1e-5
    assert first.engine.device.used_bytes <= budget

    again = LLM.load(path, mode="dense", device="emulated", vram=budget)
    assert "cached" in again.description
    larger = LLM.load(path, mode="dense", device="emulated", vram=budget * 2)
    assert "solved now" in larger.description
    assert read_gpu_split(split).extra["pitools.vram_budget"] == budget * 2
    assert sum(m.sum() for m in read_gpu_split(split).masks) >= sum(m.sum() for m in solved.masks)


def test_head_on_the_device_changes_nothing(pipeline, tmp_path):
    _, path = pipeline
    model = load_runtime_model(path)
    model.mode = FFNMode.SPARSE
    expected = stepwise_logits(model)
    masks = tuple(np.arange(model.spec.d_ff) < 100 for _ in model.layers)
    split = tmp_path / "head.gpuidx"
    write_gpu_split(split, GpuSplit(masks, vram_capacity=10**9, output_on_gpu=True))
    on_device = load_runtime_model(path, split=split, device="emulated")
    on_device.mode = FFNMode.SPARSE
    assert relative_error(stepwise_logits(on_device), expected) < 1e-5
    assert on_device.head_backend is on_device.device
    assert on_device.device.used_bytes >= on_device.output.nbytes
    # The logits come home across PCIe: every step sends at least one row of them.
    vocab = model.spec.vocab_size
    assert on_device.device.transfers.bytes_to_host >= 4 * vocab * len(TOKENS)


def test_run_command_with_a_vram_budget(pipeline, monkeypatch):
    _, path = pipeline
    default_split_path(path).unlink(missing_ok=True)
    monkeypatch.setattr(kernels, "_threads", kernels.get_threads())  # restored after --threads sets it
    args = ["run", str(path), "-p", "def ", "-n", "4", "--device", "emulated", "--vram", "200KB", "--threads", "1"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert kernels.get_threads() == 1
    assert "solved now for" in result.stderr and default_split_path(path).is_file()
    on_cpu = CliRunner().invoke(cli, ["run", str(path), "-n", "2", "--vram", "200KB"])
    assert on_cpu.exit_code == 1 and "--device cuda" in on_cpu.stderr


def test_perplexity_of_the_gguf_on_the_runtime_equals_the_reference_engine(pipeline):
    folder, path = pipeline
    common = ["--corpus", str(path.parent / "corpus.txt"), "--tokens", "300", "--seq-len", "100", "--json", "-q"]

    def perplexity(model: str, *extra: str) -> dict:
        result = CliRunner().invoke(cli, ["perplexity", model, *common, *extra])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    reference, dense = perplexity(str(folder)), perplexity(str(path))
    assert dense["scored_tokens"] == reference["scored_tokens"] == 299
    assert dense["perplexity"] == pytest.approx(reference["perplexity"], rel=1e-5)
    oracle = perplexity(str(path), "--mode", "oracle")
    predicted = perplexity(str(path), "--mode", "sparse", "--neuron-choice", "predictor")
    assert oracle["perplexity"] == pytest.approx(dense["perplexity"], rel=1e-5)
    assert 0 < predicted["selection"]["computed_density"] < 1 and np.isfinite(predicted["perplexity"])
    # The runtime counts the firing neurons its predictors miss as the reference engine counts them with the
    # same predictors (float32 both: the same choices, up to rounding near the threshold).
    predictors = path.parent / (path.name + ".work") / "predictors"
    reference_predicted = perplexity(str(folder), "--mode", "sparse", "--predictors", str(predictors))
    for key in ("recall", "computed_density", "fired_density"):
        assert predicted["selection"][key] == pytest.approx(reference_predicted["selection"][key], abs=2e-3), key
    assert predicted["perplexity"] == pytest.approx(reference_predicted["perplexity"], rel=1e-3)
    refused = CliRunner().invoke(cli, ["perplexity", str(path), "--predictors", str(folder), *common])
    assert refused.exit_code == 1 and "its own predictors" in refused.stderr


def test_cuda_without_cupy_fails_before_solving(pipeline, monkeypatch):
    _, path = pipeline
    default_split_path(path).unlink(missing_ok=True)
    monkeypatch.setattr("powerinfer_tools.runtime.backends.cupy_or_none", lambda: None)
    with pytest.raises(PitoolsError, match="CuPy with a CUDA device is not available"):
        LLM.load(path, device="cuda", vram=10**6)
    assert not default_split_path(path).exists()


def test_a_corrupt_or_foreign_cached_split_is_solved_again(pipeline):
    _, path = pipeline
    split = default_split_path(path)
    split.write_bytes(b"GGUF not really")
    assert "solved now" in LLM.load(path, mode="dense", device="emulated", vram=10**7).description
    foreign = GpuSplit((np.ones(7, bool),), vram_capacity=10, vram_budget=10**7)
    write_gpu_split(split, foreign)
    assert "solved now" in LLM.load(path, mode="dense", device="emulated", vram=10**7).description
    assert len(read_gpu_split(split).masks) == N_LAYERS
