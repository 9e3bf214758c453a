"""Mixtures of experts (Mixtral, TurboSparse-Mixtral): routing, the dense runtime against transformers,
and bad input. The reference engine's logits against MixtralForCausalLM are in test_reference_engine.py,
llama.cpp's on our dense files in test_llamacpp_dense.py."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from cli_checks import fails, invoke
from gguf_fixtures import FAST_TRAINING, SAMPLE_TEXTS, make_model, relative_error, write_code_corpus
from numpy_models import edit_config
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer

from powerinfer_tools.benchmarking.bench import predictor_summary
from powerinfer_tools.conversion.convert import convert
from powerinfer_tools.conversion.sparsify import SparsifySettings
from powerinfer_tools.formats.gpu_split import GpuSplit, default_split_path, read_gpu_split, write_gpu_split
from powerinfer_tools.formats.model_file import open_model_file
from powerinfer_tools.formats.predictor_folder import read_predictors
from powerinfer_tools.formats.profile_folder import load_profile
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.models.layers import route
from powerinfer_tools.runtime.loader import load_runtime_model
from powerinfer_tools.solver.model_stats import read_model_stats

MIXTRAL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, num_local_experts=5, num_experts_per_tok=2, sliding_window=None)
PROMPT = SAMPLE_TEXTS[1][:60]


def test_routing_is_transformers_top_k_renormalised():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    rng = np.random.default_rng(0)
    for n_experts, k in ((5, 2), (3, 1), (4, 4)):
        router = MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=n_experts, num_experts_per_tok=k))
        weight = rng.standard_normal((n_experts, 16)).astype(np.float32)
        x = rng.standard_normal((32, 16)).astype(np.float32)
        with torch.no_grad():
            router.weight.copy_(torch.from_numpy(weight))
            _, want_weights, want_experts = router(torch.from_numpy(x))
        experts, weights = route(x @ weight.T, k)
        assert np.array_equal(experts, want_experts.numpy())
        np.testing.assert_allclose(weights, want_weights.numpy(), rtol=1e-5)


def test_routing_ties_and_all_experts():
    logits = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]], dtype=np.float32)
    experts, weights = route(logits, 2)
    assert experts.tolist() == [[1, 2], [0, 1]]  # of equal probabilities, the lower expert index
    np.testing.assert_allclose(weights, 0.5)
    experts, weights = route(logits, 4)  # every expert: the weights are the softmax itself
    assert sorted(experts[0].tolist()) == [0, 1, 2, 3]
    probs = np.exp(logits[0]) / np.exp(logits[0]).sum()
    np.testing.assert_allclose(weights[0], probs[experts[0]], rtol=1e-6)


@pytest.fixture(scope="module", params=["relu", "drelu"])
def converted(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"mixtral-{request.param}")
    torch_model = make_model(folder / "ckpt", "mixtral", **dict(MIXTRAL, hidden_act="relu"),
                             build_kwargs=dict(seed=3, drelu=request.param == "drelu"))
    path, plan = convert(str(folder / "ckpt"), folder / "m.gguf", outtype="f32", dense=True, progress=False)
    return folder, torch_model, path


def test_run_greedy_gives_transformers_tokens_in_dense_mode(converted):
    folder, torch_model, path = converted
    tokenizer = Tokenizer.from_file(str(folder / "ckpt" / "tokenizer.json"))
    ids = tokenizer.encode(PROMPT).ids
    with torch.no_grad():
        out = torch_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    want = tokenizer.decode(out[0, len(ids):].tolist())
    assert len(want) >= 12
    result = invoke("run", path, "-p", PROMPT, "-n", 12, "--temp", 0, "--mode", "dense")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == PROMPT + want + "\n"


def test_expert_count_that_disagrees_with_the_tensors_is_one_error(converted, tmp_path):
    folder, _, path = converted
    # llama.expert_count is a uint32 (type 4) after its key: the file now claims 4 experts of its 5.
    data = bytearray(path.read_bytes())
    at = data.index(b"llama.expert_count") + len(b"llama.expert_count")
    assert data[at : at + 8] == (4).to_bytes(4, "little") + (5).to_bytes(4, "little")
    data[at + 4 : at + 8] = (4).to_bytes(4, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    fails("run", bad, "-n", 1, match="ffn_gate_inp.weight has shape [5, 64]; the metadata implies [4, 64]",
          names=bad)


def test_config_expert_counts_are_checked(converted, tmp_path):
    folder, _, _ = converted
    ckpt = tmp_path / "ckpt"
    shutil.copytree(folder / "ckpt", ckpt)
    edit_config(ckpt, num_local_experts=4)  # the checkpoint holds 5
    fails("convert", ckpt, "--dense", "--outtype", "f32", match="gate.weight", names=ckpt)
    edit_config(ckpt, num_local_experts=5, num_experts_per_tok=6)
    fails("convert", ckpt, "--dense", match="num_experts_per_tok is 6; it must be at most 5", names="config.json")
    edit_config(ckpt, num_local_experts=None, num_experts_per_tok=2)
    fails("convert", ckpt, "--dense", match="lacks the field 'num_local_experts'")
    assert not list(tmp_path.glob("*.gguf"))


# --- the sparse layout: profiled per expert, a predictor per expert, hot-first neurons per expert ----------


def sparse_conversion(root, config, edit_router=None):
    """A ReLU Mixtral checkpoint converted to the sparse layout (profile and predictors in its work folder)."""
    make_model(root / "ckpt", "mixtral", **config, build_kwargs=dict(seed=5))
    if edit_router is not None:
        weights = load_file(root / "ckpt" / "model.safetensors")
        for name in [n for n in weights if n.endswith("block_sparse_moe.gate.weight")]:
            weights[name] = edit_router(weights[name])
        save_file(weights, str(root / "ckpt" / "model.safetensors"), metadata={"format": "pt"})
    settings = SparsifySettings(corpus=(write_code_corpus(root / "corpus.txt"),), tokens=2048, seq_len=128,
                                train=FAST_TRAINING)
    path, plan = convert(str(root / "ckpt"), root / "m.powerinfer.gguf", outtype="f32", sparsify=settings,
                         progress=False)
    return path, root / "m.powerinfer.gguf.work"


@pytest.fixture(scope="module")
def sparse_mixtral(tmp_path_factory):
    return sparse_conversion(tmp_path_factory.mktemp("sparse-mixtral"), dict(MIXTRAL, hidden_act="relu"))


def test_profile_counts_each_experts_firing_over_the_tokens_routed_to_it(sparse_mixtral):
    path, work = sparse_mixtral
    meta, stats = load_profile(work / "profile")
    assert meta["experts"] == MIXTRAL["num_local_experts"]
    k, d_ff = MIXTRAL["num_experts_per_tok"], MIXTRAL["intermediate_size"]
    assert np.all(stats.routed.sum(axis=1) == stats.tokens * k)  # each token to k experts in every layer
    per_expert = stats.fire_count.reshape(len(stats.routed), -1, d_ff)
    assert np.all(per_expert.max(axis=2) <= stats.routed) and per_expert.sum() > 0
    model = open_model_file(path)
    for layer in range(MIXTRAL["num_hidden_layers"]):
        routing = np.array(model.get(f"pitools.blk.{layer}.expert_frequency"))
        np.testing.assert_allclose(routing, stats.routed[layer] / stats.tokens, rtol=1e-6)
        for e in range(MIXTRAL["num_local_experts"]):
            freq = np.array(model.get(f"pitools.blk.{layer}.neuron_frequency.{e}"))
            want = np.sort(per_expert[layer, e])[::-1] / stats.routed[layer, e]
            np.testing.assert_allclose(freq, want, rtol=1e-6)  # hot-first, over the expert's own tokens
            assert f"blk.{layer}.fc1.{e}.weight" in model and f"blk.{layer}.ffn_down_t.{e}.weight" in model


def test_sparse_experts_in_oracle_mode_compute_what_dense_mode_does(sparse_mixtral):
    path, _ = sparse_mixtral
    model = load_runtime_model(path)
    tokens = np.arange(40) * 11 % 500
    dense = model.forward(tokens, model.new_cache())
    model.mode = FFNMode.ORACLE
    model.stats.__init__()
    oracle = model.forward(tokens, model.new_cache())
    assert relative_error(oracle, dense) < 1e-5
    s = model.stats
    assert s.neurons_total == len(tokens) * MIXTRAL["num_experts_per_tok"] * MIXTRAL["intermediate_size"] * 2
    assert 0.2 < s.density < 0.8  # random ReLU experts fire about half their neurons
    model.mode = FFNMode.SPARSE
    assert model.can_run_sparse
    model.forward(tokens, model.new_cache())


def test_an_expert_the_profile_never_reaches_computes_every_neuron(tmp_path):
    """Top-1 of 3 experts whose router logits are (l, -l, 0): expert 2 never wins."""
    def unreachable_third(router):
        router[1], router[2] = -router[0], 0
        return router

    config = dict(MIXTRAL, hidden_act="relu", num_local_experts=3, num_experts_per_tok=1)
    path, work = sparse_conversion(tmp_path, config, unreachable_third)
    _, stats = load_profile(work / "profile")
    assert np.all(stats.routed[:, 2] == 0) and np.all(stats.routed[:, :2] > 0)
    predictors = read_predictors(work / "predictors")
    untrained = [e for e in predictors.meta["layers"] if e["expert"] == 2]
    assert len(untrained) == 2 and all(not e["tried"] and e["predicted_density"] == 1.0 for e in untrained)
    model = load_runtime_model(path)
    fc1 = model.layers[0].experts[2].predictor.fc1
    assert not np.any(fc1.data)  # all outputs 0, at the threshold: every neuron is selected
    assert np.all(np.array(open_model_file(path).get("pitools.blk.0.neuron_frequency.2")) == 0)
    model.mode = FFNMode.SPARSE
    assert np.all(np.isfinite(model.forward(np.arange(10), model.new_cache())))

    # Placement: a neuron's hotness is its expert's routing frequency times its firing frequency, so the
    # unreached expert's neurons are the coldest: the GPU takes them only after every neuron that fires.
    stats, d_ff = read_model_stats(path), config["intermediate_size"]
    file = open_model_file(path)
    for layer, freqs in enumerate(stats["freqs"]):
        routing = np.array(file.get(f"pitools.blk.{layer}.expert_frequency"))
        for e in range(3):
            want = routing[e] * np.array(file.get(f"pitools.blk.{layer}.neuron_frequency.{e}"))
            np.testing.assert_allclose(freqs[e * d_ff : (e + 1) * d_ff], want, rtol=1e-6)
    for budget in ("512.5MiB", "512.6MiB"):  # nothing fits beside the CUDA reserve; then layer 0 fits
        assert invoke("solve", path, "--vram", budget, "--force").exit_code == 0
        for mask, freqs in zip(read_gpu_split(default_split_path(path)).masks, stats["freqs"]):
            unreached = mask.reshape(3, d_ff)[2]
            assert not unreached.any() or mask[freqs > 0].all()


def test_a_split_of_experts_computes_what_the_cpu_does(sparse_mixtral, tmp_path):
    path, _ = sparse_mixtral
    rng = np.random.default_rng(0)
    n = MIXTRAL["num_local_experts"] * MIXTRAL["intermediate_size"]
    split = tmp_path / "half.gpuidx"
    write_gpu_split(split, GpuSplit((rng.random(n) < 0.5, rng.random(n) < 0.5), vram_capacity=10**9,
                                    dense_on_gpu=(True, False)))
    tokens = np.arange(30) * 7 % 500
    for mode in (FFNMode.DENSE, FFNMode.ORACLE):
        logits = []
        for use_split in (False, True):
            model = load_runtime_model(path, split=split, use_split=use_split, device="emulated")
            model.mode = mode
            logits.append(model.forward(tokens, model.new_cache()))
        assert relative_error(logits[1], logits[0]) < 1e-5
        assert 0.3 < model.stats.device_share < 0.7


@pytest.mark.parametrize("mode", [FFNMode.DENSE, FFNMode.SPARSE])
def test_compiled_decoding_of_experts_equals_the_general_path(sparse_mixtral, mode):
    path, _ = sparse_mixtral
    logits, stats = {}, {}
    for compiled in (True, False):
        model = load_runtime_model(path)
        model.mode, model.compiled_decoding = mode, compiled
        assert (model.compiled_decoder() is not None) == compiled
        step = model.step_fn()
        step(np.arange(6) * 13 % 500)  # the prompt: the general path in both
        logits[compiled] = np.stack([step(np.array([t])) for t in (3, 141, 59, 265, 35)])
        stats[compiled] = model.stats
    assert relative_error(logits[True], logits[False]) < 1e-4
    for field in ("neurons_total", "neurons_active", "bytes_read"):
        assert getattr(stats[True], field) == getattr(stats[False], field), field


def test_inspect_names_the_experts(sparse_mixtral):
    path, _ = sparse_mixtral
    text = invoke("inspect", path).stdout
    assert "predictors in 10 of 10 experts" in text and "a mixture of 5 experts per layer (2 per token)" in text


def test_experts_under_a_ram_budget_compute_what_they_do_in_memory(sparse_mixtral):
    """Each expert's cold neurons behind its own neuron cache: the same logits (up to summation order: a
    cached mixture takes the general path), the budget kept."""
    path, _ = sparse_mixtral
    tokens = np.arange(24) * 5 % 500
    budget = int(0.8 * path.stat().st_size)
    logits = []
    for ram in (None, budget):
        model = load_runtime_model(path, ram=ram)
        model.mode = FFNMode.SPARSE
        step = model.step_fn()
        logits.append(np.stack([step(tokens[:8])] + [step(tokens[i : i + 1]) for i in range(8, len(tokens))]))
    assert relative_error(logits[1], logits[0]) < 1e-5
    assert model.ram.resident_bytes <= budget
    assert len(model.ram.caches) == MIXTRAL["num_hidden_layers"] * MIXTRAL["num_local_experts"]
    assert model.stats.cache_misses > 0 and model.stats.disk_bytes > 0


def test_bench_counts_only_the_routed_experts_predictor_bytes(sparse_mixtral):
    path, _ = sparse_mixtral
    file = open_model_file(path)
    want = sum(file.get(f"pitools.blk.{layer}.expert_frequency")[e]
               * (file[f"blk.{layer}.fc1.{e}.weight"].nbytes + file[f"blk.{layer}.fc2.{e}.weight"].nbytes)
               for layer in range(2) for e in range(5))
    stored = sum(t.nbytes for name, t in file.tensors.items() if ".fc1." in name or ".fc2." in name)
    assert predictor_summary(path)["bytes_per_token"] == pytest.approx(want)
    assert want == pytest.approx(stored * 2 / 5, rel=0.2)  # about 2 of 5 experts' worth
