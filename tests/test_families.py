"""Our reference engine, converter and runtime on the Llama 3.1/3.2 (llama3, linear and yarn rope scalings), Qwen3,
Phi-3, Phi-3.5 (longrope) and Gemma 2 families, against the oracles no one here wrote (tests/test_family_oracles.py
checks them against each other): transformers on the small random checkpoints of tests/family_checkpoints.py,
llama.cpp on the GGUF files its own converter writes of them, which are the files users download."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from cli_checks import fails, invoke
from family_checkpoints import FAMILIES, LONGROPE_ORIGINAL_CONTEXT
from gguf import MODEL_TENSOR, GGUFValueType
from gguf_fixtures import EVAL_TOKENS, EVAL_SEQ_LEN, llama, llamacpp_perplexity, our_perplexity, rewrite_gguf, training_texts
from oracle_decoding import (
    F32_ERROR,
    STEPS,
    agreeing_prefix,
    llamacpp_logits_and_greedy,
    prompt_ids,
    relative_error,
    transformers_greedy,
    transformers_logits,
)
from runtime_decoding import runtime_logits_and_greedy

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.conversion.convert import convert
from powerinfer_tools.conversion.gguf_source import GGUFSource
from powerinfer_tools.conversion.sparsify import SparsifySettings
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.activation_thresholds import read_thresholds
from powerinfer_tools.formats.model_file import open_model_file
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.models import load_model, spec_from_config
from powerinfer_tools.profiling.corpus import CorpusSource, read_tokens
from powerinfer_tools.runtime.loader import load_runtime_model


@pytest.mark.parametrize("name", FAMILIES)
def test_the_reference_engine_computes_what_transformers_computes(family_checkpoint, llamacpp_gguf, name):
    built = family_checkpoint(name)
    ids = prompt_ids(llamacpp_gguf(name))
    model = load_model(Checkpoint(built.folder))
    ours = model.forward(np.array(ids), model.new_cache()).astype(np.float64)
    assert relative_error(ours, transformers_logits(built.reference, ids)) < F32_ERROR


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-decoder", "general-path"])
@pytest.mark.parametrize("name", FAMILIES)
def test_the_runtime_computes_llamacpps_file_as_llamacpp_does(llamacpp_gguf, name, compiled):
    """The file llama.cpp's converter writes, as users download it: every prompt position's logits and the greedy
    continuation, on either one-token path."""
    path = llamacpp_gguf(name)
    ids = prompt_ids(path)
    theirs, their_tokens = llamacpp_logits_and_greedy(path, ids, STEPS)
    ours, our_tokens, model = runtime_logits_and_greedy(path, ids, compiled)
    assert model.layer_paths() == (["compiled decoder" if compiled else "general path (compiled decoding turned off)"]
                                   * len(model.layers))
    assert relative_error(ours, theirs) < FAMILIES[name].llamacpp_error
    assert our_tokens == their_tokens, f"the same for {agreeing_prefix(our_tokens, their_tokens)} tokens"


@pytest.mark.parametrize("name", FAMILIES)
def test_perplexity_on_llamacpps_file_is_llamacpps(tmp_path, llamacpp_gguf, name):
    """``pitools perplexity`` on the file: the text tokenized as llama.cpp tokenizes it, and its perplexity over the
    same windows within 0.1% of llama.cpp's (f32 on both sides)."""
    path = llamacpp_gguf(name)
    corpus = tmp_path / "text.txt"
    corpus.write_text("\n".join(training_texts()))
    model = load_runtime_model(path)
    tokens = read_tokens(CorpusSource((corpus,)), GGUFSource(path).tokenizer(model.spec), EVAL_TOKENS)
    add_bos = bool(tokens[0] == model.spec.bos_token_id)
    assert tokens.tolist() == llama(path, vocab_only=True).tokenize(corpus.read_bytes(), add_bos=add_bos)[:EVAL_TOKENS]
    ours, theirs = our_perplexity(path, corpus), llamacpp_perplexity(path, tokens, EVAL_SEQ_LEN)
    assert abs(ours / theirs - 1) < 1e-3, (ours, theirs)


@pytest.mark.parametrize("name", FAMILIES)
def test_our_dense_file_is_llamacpps(tmp_path, family_checkpoint, llamacpp_gguf, name):
    """``pitools convert --dense`` of the checkpoint writes what llama.cpp computes as transformers does (Llama 3.1's
    rope_freqs, Phi-3's fused tensors, Qwen3's q/k norms as its converter writes them), and converting llama.cpp's
    own file reads it back as that checkpoint."""
    built = family_checkpoint(name)
    ours, _ = convert(str(built.folder), tmp_path / "ours.gguf", outtype="f32", dense=True, progress=False)
    ids = prompt_ids(llamacpp_gguf(name))
    logits, _ = llamacpp_logits_and_greedy(ours, ids, 0)
    assert relative_error(logits, transformers_logits(built.reference, ids)) < FAMILIES[name].llamacpp_error
    again, _ = convert(str(llamacpp_gguf(name)), tmp_path / "again.gguf", outtype="f32", dense=True, progress=False)
    source = load_model(Checkpoint(built.folder))
    # (our files hold output.weight, a tied model's copy of the embedding, where the family has one: PowerInfer's
    # loader needs it; llama.cpp's gemma2 has none)
    expected = load_runtime_model(llamacpp_gguf(name)).spec
    if expected.architecture.has(MODEL_TENSOR.OUTPUT):
        expected = dataclasses.replace(expected, tied_embeddings=False)
    assert load_runtime_model(again).spec == expected
    logits, _ = llamacpp_logits_and_greedy(again, ids, 0)
    assert relative_error(logits, source.forward(np.array(ids), source.new_cache())) < FAMILIES[name].llamacpp_error


@pytest.mark.parametrize("name", ["llama3.1", "qwen3", "phi3"])
def test_a_thresholded_file_computes_the_rule_as_the_reference(tmp_path, family_checkpoint, llamacpp_gguf, name):
    """``--target-sparsity`` (CATS): the sparse file (Phi-3's fused gate and up written apart) computes what the
    reference engine computes with the same thresholds, on the compiled decoder, and skips neurons."""
    built = family_checkpoint(name)
    corpus = tmp_path / "calibration.txt"
    corpus.write_text("\n".join(FAMILIES[name].config.keys()) * 200 + open(__file__).read())
    path, _ = convert(str(built.folder), tmp_path / "m.powerinfer.gguf", outtype="f32", progress=False,
                      sparsify=SparsifySettings(corpus=(corpus,), tokens=2048, target_sparsity=0.4))
    ids = prompt_ids(llamacpp_gguf(name))
    ours, _, model = runtime_logits_and_greedy(path, ids, compiled=True, steps=0, mode=FFNMode.SPARSE)
    reference = load_model(Checkpoint(built.folder))
    reference.activation_thresholds = read_thresholds(open_model_file(path).get, reference.spec.n_layers, "f")
    theirs = reference.forward(np.array(ids), reference.new_cache())
    assert (np.abs(ours - theirs).max(axis=1) < 1e-3).mean() >= 0.75
    assert np.mean(ours.argmax(axis=1) == theirs.argmax(axis=1)) >= 0.95
    assert 0.3 < model.stats.density < 0.9


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3.1", "qwen3", "phi3"])
def test_a_quality_budget_chooses_each_layers_sparsity(tmp_path, family_checkpoint, name):
    """``--max-quality-loss``: per-layer sparsity chosen on held-out perplexity; the file runs sparse."""
    built = family_checkpoint(name)
    corpus = tmp_path / "calibration.txt"
    corpus.write_text("\n".join(training_texts()))
    path, _ = convert(str(built.folder), tmp_path / "m.powerinfer.gguf", outtype="f32", progress=False,
                      sparsify=SparsifySettings(corpus=(corpus,), tokens=4096, max_quality_loss=0.2))
    model = load_runtime_model(path)
    model.mode = FFNMode.SPARSE
    model.forward(np.arange(1, 33), model.new_cache())
    assert model.stats.density < 1.0
    assert invoke("perplexity", path, "--corpus", corpus, "--tokens", 1024, "-q").exit_code == 0


def test_within_the_trained_context_longrope_rotates_by_its_short_factors(family_checkpoint, llamacpp_gguf):
    """A context window of original_max_position_embeddings: the reference engine and the runtime (either one-token
    path) rotate by the short factors, as transformers does on a sequence that stays within it, to the same logits
    and greedy tokens; the long factors (the model's own window) give logits far beyond the tolerance. (llama.cpp
    cannot be asked: it rounds its window up to a multiple of 256 positions, beyond this model's 32.)"""
    built, path, steps = family_checkpoint("phi3.5"), llamacpp_gguf("phi3.5"), 8
    ids = prompt_ids(path)[: LONGROPE_ORIGINAL_CONTEXT - steps]  # the last greedy step at the window's last position
    expected = transformers_logits(built.reference, ids)
    expected_tokens = transformers_greedy(built.reference, ids, steps)
    reference = load_model(Checkpoint(built.folder))
    reference.context_size = LONGROPE_ORIGINAL_CONTEXT
    assert relative_error(reference.forward(np.array(ids), reference.new_cache()), expected) < F32_ERROR
    for compiled in (True, False):
        ours, our_tokens, _ = runtime_logits_and_greedy(path, ids, compiled, steps,
                                                        context_size=LONGROPE_ORIGINAL_CONTEXT)
        assert relative_error(ours, expected) < F32_ERROR
        assert our_tokens == expected_tokens, f"the same for {agreeing_prefix(our_tokens, expected_tokens)} tokens"
    long_factors, _, _ = runtime_logits_and_greedy(path, ids, compiled=True, steps=0)
    assert relative_error(long_factors, expected) > 100 * F32_ERROR


def test_a_tensor_the_family_does_not_apply_is_refused(tmp_path, llamacpp_gguf):
    """longrope's factors in a Llama file would be ignored (llama.cpp's llama rotates by them, we would not): the
    file is refused, naming the tensor, by every command."""
    import shutil

    path = tmp_path / "llama.gguf"
    shutil.copy(llamacpp_gguf("llama3.1"), path)
    rewrite_gguf(path, {}, add_tensors={"rope_factors_long.weight": np.ones(16, dtype=np.float32)})
    for command in (["run", path, "-p", "x", "-n", "1"], ["convert", path, "--dense", "-o", tmp_path / "o.gguf"]):
        fails(*command, match="tensor rope_factors_long.weight is not part of a llama model", names=path)


@pytest.mark.parametrize("tensors, match", [
    ({"rope_factors_long.weight": np.ones(16)}, "tensor rope_factors_short.weight is missing: a longrope model needs"),
    ({"rope_factors_long.weight": np.ones(8), "rope_factors_short.weight": np.ones(8)},
     "tensor rope_factors_short.weight needs 16 positive factors (one per rotation pair), not (1.0, 1.0"),
])
def test_a_phi3_file_with_longrope_it_cannot_compute_is_refused(tmp_path, llamacpp_gguf, tensors, match):
    import shutil

    path = tmp_path / "phi3.gguf"
    shutil.copy(llamacpp_gguf("phi3"), path)
    rewrite_gguf(path, {}, add_tensors={name: values.astype(np.float32) for name, values in tensors.items()})
    fails("run", path, "-p", "x", "-n", "1", match=match, names=path)


def longrope_config(**changes) -> dict:
    """The phi3.5 checkpoint's config.json (tests/family_checkpoints.py), its rope_scaling changed by ``changes``."""
    family = FAMILIES["phi3.5"]
    scaling = {k: v for k, v in dict(family.config["rope_scaling"], **changes).items() if v is not None}
    return dict(family.config, model_type="phi3", vocab_size=1024, rope_scaling=scaling)


@pytest.mark.parametrize("config, match", [
    (longrope_config(short_factor=[1.0] * 15), r"rope_scaling short_factor needs 16 positive factors \(one per"),
    (longrope_config(long_factor=[1.0] * 15 + [-1.0]), r"rope_scaling long_factor needs 16 positive factors"),
    (longrope_config(long_factor=None), r"longrope rope scaling lacks its 'long_factor'"),
    (longrope_config(rope_type="su"), r"rope scaling type 'su' is not supported"),
    (longrope_config(partial_rotary_factor=0.75), r"phi3 models with partial_rotary_factor=0.75 are not supported"),
    (dict(longrope_config(), partial_rotary_factor=0.75), r"phi3 models with partial_rotary_factor=0.75 are not"),
    (dict(longrope_config(), original_max_position_embeddings=None),
     r"longrope rope scaling lacks original_max_position_embeddings \(the context its short factors are for\)$"),
    (longrope_config(attention_factor=1.0), r"longrope rope scaling with attention_factor=1.0 is not supported "
                                            r"\(it sets an attention factor of 1; llama.cpp's converter writes the "
                                            r"one max_position_embeddings implies, 1.41421\)"),
    (longrope_config(factor=4.0), r"longrope rope scaling with factor=4.0 is not supported"),
    (dict(longrope_config(), model_type="llama"), r"rope_scaling type 'longrope' is not supported for llama models"),
])
def test_a_longrope_config_we_cannot_compute_is_refused(config, match):
    with pytest.raises(PitoolsError, match=f"^x/config.json: {match}"):
        spec_from_config(config, "x/config.json")


def test_a_longrope_config_that_says_what_llamacpp_writes_is_read():
    """attention_factor and factor where they say what llama.cpp's converter derives (Phi-3.5's own configs)."""
    same = spec_from_config(longrope_config(attention_factor=2 ** 0.5, factor=1024 / 32))
    assert same.rope_scaling == spec_from_config(longrope_config()).rope_scaling
    assert same.rope_scaling.attention_factor == pytest.approx(2 ** 0.5)


@pytest.mark.parametrize("key, value", [("llama.attention.scale", 0.5), ("llama.rope.scaling.attn_factor", 2.0)])
def test_a_key_the_family_does_not_apply_is_refused(tmp_path, llamacpp_gguf, key, value):
    import shutil

    path = tmp_path / "llama.gguf"
    shutil.copy(llamacpp_gguf("llama3.1"), path)
    rewrite_gguf(path, {key: (value, GGUFValueType.FLOAT32)})
    fails("run", path, "-p", "x", "-n", "1", match=f"metadata key {key} ({value}) changes what a llama model computes",
          names=path)


def test_the_neutral_value_of_a_key_is_accepted(tmp_path, llamacpp_gguf):
    import shutil

    path = tmp_path / "llama.gguf"
    shutil.copy(llamacpp_gguf("llama3.1"), path)
    rewrite_gguf(path, {"llama.rope.scaling.attn_factor": (1.0, GGUFValueType.FLOAT32)})
    assert invoke("run", path, "-p", "x", "-n", "1").exit_code == 0
