"""The runtime on converted GGUF files against the reference engine on the original checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
from gguf_fixtures import (
    TOKENS,
    make_model,
    random_predictors,
    relative_error,
    save_predictors,
    stepwise_logits,
)
from hf_models import reference_logits
from powerinfer_tools.formats.gpu_split import GpuSplit, write_gpu_split
from powerinfer_tools.formats.predictor_rule import predict

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.conversion.convert import convert
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.models import load_model
from powerinfer_tools.runtime.loader import load_runtime_model

LLAMA = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=64, hidden_act="relu")
OPT = dict(hidden_size=48, ffn_dim=136, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
           word_embed_proj_dim=48, pad_token_id=1)
MODELS = {
    "llama-reglu": ("llama", LLAMA, {}),
    "llama-drelu": ("llama", LLAMA, dict(drelu=True)),
    "opt": ("opt", OPT, {}),
    # q/k/v biases and halves rope in our sparse layout too; dReLU, which stays "qwen2" (not "bamboo")
    "qwen2-drelu": ("qwen2", LLAMA, dict(drelu=True)),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def converted(request, tmp_path_factory):
    """(checkpoint folder, predictor layers, {outtype: PowerInfer GGUF path})."""
    family, config, build = MODELS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    folder = root / "model"
    make_model(folder, family, build_kwargs=build, **config)
    spec = load_model(Checkpoint(folder)).spec
    predictors = random_predictors(spec.n_layers, spec.d_model, spec.d_ff, hidden=12, seed=3)
    save_predictors(root / "pred", predictors)
    files = {}
    for outtype in ("f32", "q8_0", "q4_0"):
        files[outtype], _ = convert(str(folder), root / f"m.{outtype}.gguf", outtype=outtype,
                                    predictors=root / "pred", progress=False)
    return folder, predictors, files


def reference(folder, predictors=None):
    """The reference engine's logits; with ``predictors``, only the neurons they select are computed.

    The predictors read the residual before the FFN norm, as PowerInfer's runtime does.
    """
    model = load_model(Checkpoint(folder), np.float64)
    if predictors is not None:
        model.neuron_selector = lambda layer, residual, fired: predict(*predictors[layer], residual)
    return model.forward(TOKENS, model.new_cache())


def test_dense_f32_equals_reference_engine(converted):
    folder, _, files = converted
    model = load_runtime_model(files["f32"])
    assert relative_error(stepwise_logits(model), reference(folder)) < 1e-4


def test_oracle_equals_dense(converted):
    _, _, files = converted
    model = load_runtime_model(files["f32"])
    dense = stepwise_logits(model)
    model.mode = FFNMode.ORACLE
    assert relative_error(stepwise_logits(model), dense) < 1e-5
    assert model.stats.neurons_active < model.stats.neurons_total  # oracle skipped non-firing neurons


def test_sparse_equals_reference_predicted_path(converted):
    folder, predictors, files = converted
    model = load_runtime_model(files["f32"])
    model.mode = FFNMode.SPARSE
    sparse = stepwise_logits(model)
    assert relative_error(sparse, reference(folder, predictors)) < 1e-4
    assert relative_error(sparse, reference(folder)) > 1e-3  # the predictors really changed the result


@pytest.mark.parametrize("share", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("mode", [FFNMode.DENSE, FFNMode.SPARSE])
def test_split_across_emulated_device_changes_nothing(converted, tmp_path, share, mode):
    _, _, files = converted
    baseline = load_runtime_model(files["f32"])
    baseline.mode = mode
    expected = stepwise_logits(baseline)
    spec = baseline.spec
    rng = np.random.default_rng(int(share * 10))
    masks = tuple(rng.random(spec.d_ff) < share for _ in range(spec.n_layers))
    split = tmp_path / "m.gpuidx"
    write_gpu_split(split, GpuSplit(masks, vram_capacity=10**9, dense_on_gpu=(True, False)))
    model = load_runtime_model(files["f32"], split=split, device="emulated")
    model.mode = mode
    assert relative_error(stepwise_logits(model), expected) < 1e-5
    on_device = model.stats.neurons_on_device / model.stats.neurons_active
    assert (on_device > 0) == (share > 0) and (on_device < 1) == (share < 1)
    if share > 0:
        assert model.device.transfers.bytes_to_device > 0


def test_split_over_budget_is_refused(converted, tmp_path):
    _, _, files = converted
    spec = load_runtime_model(files["f32"]).spec
    masks = tuple(np.ones(spec.d_ff, bool) for _ in range(spec.n_layers))
    split = tmp_path / "m.gpuidx"
    write_gpu_split(split, GpuSplit(masks, vram_capacity=1000, vram_budget=1000))
    with pytest.raises(Exception, match="exceed the VRAM budget"):
        load_runtime_model(files["f32"], split=split)


def test_split_for_another_model_is_refused(converted, tmp_path):
    _, _, files = converted
    split = tmp_path / "m.gpuidx"
    write_gpu_split(split, GpuSplit((np.ones(7, bool),), vram_capacity=10**9))
    with pytest.raises(Exception, match="split has 1 layers"):
        load_runtime_model(files["f32"], split=split)


def test_q8_0_file_stays_close_to_f32(converted):
    """Random weights amplify rounding (q4_0 moves these logits by tens of percent), so this is a
    loose check; top-1 agreement of q8_0 and q4_0 on real text is measured on the bundled model."""
    _, _, files = converted
    ref = stepwise_logits(load_runtime_model(files["f32"]))
    assert relative_error(stepwise_logits(load_runtime_model(files["q8_0"])), ref) < 0.1


QWEN2 = dict(LLAMA, hidden_act="silu")


@pytest.mark.parametrize("tied", [False, True])
def test_qwen2_dense_file_gives_transformers_logits(tmp_path, tied):
    """A Qwen2 file keeps q and k in the checkpoint's row order (llama.cpp's neox rope) and has q/k/v
    biases: the runtime's general path (the prompt) and its compiled one-token path (each later token)
    give transformers' logits, and so does the general path alone."""
    folder = tmp_path / "model"
    torch_model = make_model(folder, "qwen2", tie_word_embeddings=tied, **QWEN2)
    path, _ = convert(str(folder), tmp_path / "m.gguf", outtype="f32", dense=True, progress=False)
    want = reference_logits(torch_model, TOKENS)
    model = load_runtime_model(path)
    assert model.spec.architecture.name == "qwen2" and model.spec.attention_bias
    assert set(model.layers[0].dense.biases) == {"q", "k", "v"}
    assert model.compiled_decoder() is not None
    assert relative_error(stepwise_logits(model), want) < 1e-4
    model.compiled_decoding = False
    assert relative_error(stepwise_logits(model), want) < 1e-4
