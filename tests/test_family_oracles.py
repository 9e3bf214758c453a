"""The oracles of the Llama 3.1/3.2, Qwen3, Phi-3, Phi-3.5 and Gemma 2 families checked against each other: transformers
on the small random checkpoints of tests/family_checkpoints.py, llama.cpp (llama-cpp-python) on the GGUF files
llama.cpp's own converter writes of them (tests/llamacpp_converter.py). Where the two agree, either is a reference
for our runtime; the checks below also pin down what the files hold (tensors, rope factors, longrope's two lists,
the sliding window, Gemma 2's caps) and that the features that set the families apart (rope scaling, the window,
the caps: tests/test_gemma2.py) change the logits by far more than the tolerance, so that a runtime which ignores
one cannot pass a comparison with these oracles.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import transformers
from family_checkpoints import (FAMILIES, HEAD_DIM, LONGROPE_ORIGINAL_CONTEXT, build_checkpoint,
                                train_sentencepiece_tokenizer)
from gguf import GGUFReader, GGUFValueType
from gguf_fixtures import SAMPLE_TEXTS, llama
from llamacpp_converter import ConverterUnavailable, convert_checkpoint, converter_folder
from oracle_decoding import (
    F16_ERROR,
    F32_ERROR,
    STEPS,
    agreeing_prefix,
    llamacpp_logits_and_greedy,
    prompt_ids,
    relative_error,
    transformers_greedy,
    transformers_logits,
)
from safetensors.numpy import load_file

# Text on which SmolLM2's pre-tokenizer (digits split one by one first) and GPT-2's differ.
DIGIT_TEXTS = ["x  +  1", "a 12345 b  678\t9", " 1 22  333   4444", "3.14 1e-5 0x1F ５６ ٣٤ ¹²³ ½"]
# Per-layer tensors of each architecture's file (blk.N.* without the N), besides the norms attn_norm and ffn_norm.
BLOCK_TENSORS = {
    "llama": {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"},
    "qwen3": {"attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_gate", "ffn_up",
              "ffn_down"},
    "phi3": {"attn_qkv", "attn_output", "ffn_up", "ffn_down"},  # ffn_up: gate and up, fused
    "gemma2": {"attn_q", "attn_k", "attn_v", "attn_output", "post_attention_norm", "ffn_gate", "ffn_up", "ffn_down",
               "post_ffw_norm"},
}


def reloaded_with(folder, tmp_path, **config):
    """transformers' model of ``folder``'s weights with ``config`` changed in its config.json."""
    copy = tmp_path / f"{folder.name}-changed"
    copy.mkdir()
    for item in folder.iterdir():
        (copy / item.name).symlink_to(item)
    (copy / "config.json").unlink()
    (copy / "config.json").write_text(json.dumps(json.loads((folder / "config.json").read_text()) | config))
    return transformers.AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float32).eval()


def tensors_and_metadata(path) -> tuple[dict[str, np.ndarray], dict]:
    """A GGUF file's tensors, and its metadata's single values (the tokenizer's lists left out)."""
    reader = GGUFReader(path)
    metadata = {k: f.contents() for k, f in reader.fields.items() if f.types[0] != GGUFValueType.ARRAY}
    return {t.name: np.asarray(t.data) for t in reader.tensors}, metadata


@pytest.mark.parametrize("name", FAMILIES)
def test_llamacpp_computes_what_transformers_computes(family_checkpoint, llamacpp_gguf, name):
    """Every prompt position's f32 logits within the family's ``llamacpp_error`` (F32_ERROR but where ggml's GELU
    table rounds), and the same STEPS greedy tokens, which vary."""
    path, model = llamacpp_gguf(name), family_checkpoint(name).reference
    ids = prompt_ids(path)
    theirs, continuation = llamacpp_logits_and_greedy(path, ids, STEPS)
    error = relative_error(theirs, transformers_logits(model, ids))
    assert error < FAMILIES[name].llamacpp_error, error
    expected = transformers_greedy(model, ids, STEPS)
    assert continuation == expected, f"the same for {agreeing_prefix(continuation, expected)} tokens"
    assert len(set(expected)) > STEPS // 2, expected


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_llamacpp_f16_files_compute_what_transformers_computes(family_checkpoint, llamacpp_gguf, name):
    """The converter's f16 (matrices in f16; norms and rope factors stay f32): logits within F16_ERROR."""
    path, model = llamacpp_gguf(name, "f16"), family_checkpoint(name).reference
    types = {re.sub(r"blk\.\d+\.", "", t.name): t.tensor_type.name for t in GGUFReader(path).tensors}
    assert {types[n] for n in types if "norm" in n or n == "rope_freqs.weight"} == {"F32"}
    assert types["token_embd.weight"] == "F16"
    ids = prompt_ids(path)
    theirs, _ = llamacpp_logits_and_greedy(path, ids, 0)
    error = relative_error(theirs, transformers_logits(model, ids))
    assert error < F16_ERROR, error


@pytest.mark.parametrize("name", ["llama3.1", "phi3"])
def test_the_checkpoints_tokenizer_tokenizes_as_llamacpp_does_on_the_file(family_checkpoint, llamacpp_gguf, name):
    """SmolLM2's rebuilt tokenizer (transformers) and the trained tokenizer.model (sentencepiece) against llama.cpp
    on the converted file; the rebuilt one also against llama.cpp on SmolLM2's own file."""
    from powerinfer_tools.benchmarking.real_models import fetch

    folder, path = family_checkpoint(name).folder, llamacpp_gguf(name)
    files = [llama(path, vocab_only=True)]
    if FAMILIES[name].tokenizer == "bpe":
        encode = transformers.AutoTokenizer.from_pretrained(folder).encode
        files.append(llama(fetch("smollm2", progress=False), vocab_only=True))
        assert files[0].metadata["tokenizer.ggml.pre"] == "smollm"
    else:
        import sentencepiece

        encode = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model")).encode
    for text in SAMPLE_TEXTS + DIGIT_TEXTS:
        want = encode(text) if FAMILIES[name].tokenizer == "sentencepiece" else encode(text, add_special_tokens=False)
        for file in files:
            assert file.tokenize(text.encode(), add_bos=False, special=False) == want, text


@pytest.mark.parametrize("name", ["llama3.1", "llama3.2"])
def test_llama3_rope_factors_are_transformers_frequencies(family_checkpoint, llamacpp_gguf, name):
    """rope_freqs.weight (one factor per frequency, dividing it) gives transformers' llama3 frequencies; some are
    kept, one is smoothed, the rest divided by the factor."""
    model, factor = family_checkpoint(name).reference, FAMILIES[name].config["rope_scaling"]["factor"]
    factors = tensors_and_metadata(llamacpp_gguf(name))[0]["rope_freqs.weight"]
    theta = FAMILIES[name].config["rope_theta"]
    plain = theta ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    np.testing.assert_allclose(plain / factors, model.model.rotary_emb.inv_freq.numpy(), rtol=1e-6)
    assert (factors == 1).sum() == 8 and (factors == factor).sum() == 7 and 1 < factors[8] < factor


def test_longrope_factors_are_transformers_frequencies(family_checkpoint, llamacpp_gguf):
    """rope_factors_short.weight and rope_factors_long.weight (each dividing the frequencies) give transformers'
    frequencies within the trained context and beyond it, and rope.scaling.attn_factor the scale of its cos and sin;
    the two lists differ."""
    rotary = family_checkpoint("phi3.5").reference.model.rotary_emb
    tensors, metadata = tensors_and_metadata(llamacpp_gguf("phi3.5"))
    plain = FAMILIES["phi3.5"].config["rope_theta"] ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    short = plain / tensors["rope_factors_short.weight"]
    np.testing.assert_allclose(short, rotary.original_inv_freq.numpy(), rtol=1e-6)
    beyond = torch.arange(LONGROPE_ORIGINAL_CONTEXT + 1)[None]  # transformers switches to the long factors here
    rotary(torch.zeros(1, len(beyond[0]), HEAD_DIM), beyond)
    np.testing.assert_allclose(plain / tensors["rope_factors_long.weight"], rotary.inv_freq.numpy(), rtol=1e-6)
    assert not np.allclose(tensors["rope_factors_long.weight"], tensors["rope_factors_short.weight"])
    assert metadata["phi3.rope.scaling.attn_factor"] == pytest.approx(rotary.attention_scaling, rel=1e-6)
    assert metadata["phi3.rope.scaling.original_context_length"] == LONGROPE_ORIGINAL_CONTEXT


@pytest.mark.parametrize("name", ["llama3.1", "llama3.2", "llama-linear", "llama-yarn", "phi3.5"])
def test_the_rope_scaling_changes_the_logits_far_beyond_the_tolerance(tmp_path, family_checkpoint, llamacpp_gguf,
                                                                      name):
    built = family_checkpoint(name)
    ids = prompt_ids(llamacpp_gguf(name))
    unscaled = reloaded_with(built.folder, tmp_path, rope_scaling=None)
    error = relative_error(transformers_logits(unscaled, ids), transformers_logits(built.reference, ids))
    assert error > 100 * F32_ERROR, error


@pytest.mark.parametrize("name", FAMILIES)
def test_the_converted_file_holds_the_families_tensors(family_checkpoint, llamacpp_gguf, name):
    """What the runtime will read: the architecture, the per-layer tensors, an output matrix unless tied, the
    llama3 rope factors; Qwen3's q/k norms per head and unpermuted q/k rows (neox rope); Phi-3's fused qkv and
    gate-up matrices as the checkpoint holds them (gate first), its window and original context in metadata; Gemma
    2's norms stored as 1 + w, its window and caps in metadata (its layer pattern and query scale are llama.cpp's
    assumptions: none)."""
    family, path = FAMILIES[name], llamacpp_gguf(name)
    tensors, metadata = tensors_and_metadata(path)
    blocks = {re.sub(r"^blk\.\d+\.|\.weight$", "", n) for n in tensors if n.startswith("blk.")}
    assert metadata["general.architecture"] == family.architecture
    assert blocks == BLOCK_TENSORS[family.architecture] | {"attn_norm", "ffn_norm"}
    assert ("output.weight" in tensors) != family.config.get("tie_word_embeddings", False)
    scaling = (family.config.get("rope_scaling") or {}).get("rope_type")
    assert ("rope_freqs.weight" in tensors) == (scaling == "llama3")
    longrope = scaling == "longrope"
    assert ("rope_factors_long.weight" in tensors) == ("rope_factors_short.weight" in tensors) == longrope
    checkpoint = load_file(family_checkpoint(name).folder / "model.safetensors")
    layer = "model.layers.1."
    if family.architecture == "qwen3":
        assert tensors["blk.1.attn_q_norm.weight"].shape == (HEAD_DIM,)
        np.testing.assert_array_equal(tensors["blk.1.attn_q.weight"], checkpoint[layer + "self_attn.q_proj.weight"])
    if family.architecture == "phi3":
        np.testing.assert_array_equal(tensors["blk.1.attn_qkv.weight"], checkpoint[layer + "self_attn.qkv_proj.weight"])
        np.testing.assert_array_equal(tensors["blk.1.ffn_up.weight"], checkpoint[layer + "mlp.gate_up_proj.weight"])
        assert metadata["phi3.attention.sliding_window"] == family.config["sliding_window"]
        original_context = family.config["original_max_position_embeddings"]
        assert metadata["phi3.rope.scaling.original_context_length"] == original_context
    if family.architecture == "gemma2":
        np.testing.assert_array_equal(tensors["blk.1.post_ffw_norm.weight"],
                                      checkpoint[layer + "post_feedforward_layernorm.weight"] + 1)
        assert {key: metadata[f"gemma2.{key}"] for key in ("attention.sliding_window", "attn_logit_softcapping",
                                                            "final_logit_softcapping")} == {
            "attention.sliding_window": family.config["sliding_window"],
            "attn_logit_softcapping": family.config["attn_logit_softcapping"],
            "final_logit_softcapping": family.config["final_logit_softcapping"]}
        assert not any("pattern" in key or "scale" in key for key in metadata if key.startswith("gemma2."))


@pytest.mark.slow
def test_llamacpp_ignores_phi3s_sliding_window(tmp_path):
    """With a window of 8, llama.cpp's phi3 computes full causal attention ("Phi SWA is currently disabled"):
    transformers without the window, not transformers with it."""
    built = build_checkpoint("phi3", tmp_path / "phi3", train_sentencepiece_tokenizer(tmp_path / "spm"),
                             sliding_window=8)
    try:
        path = convert_checkpoint(built.folder, tmp_path / "phi3.gguf")
    except ConverterUnavailable as exc:
        pytest.skip(f"llama.cpp's converter cannot be fetched: {exc}")
    assert tensors_and_metadata(path)[1]["phi3.attention.sliding_window"] == 8
    ids = prompt_ids(path)
    theirs, _ = llamacpp_logits_and_greedy(path, ids, 0)
    full = reloaded_with(built.folder, tmp_path, sliding_window=None)
    assert relative_error(theirs, transformers_logits(full, ids)) < F32_ERROR
    assert relative_error(theirs, transformers_logits(built.reference, ids)) > 100 * F32_ERROR


def test_a_registry_out_of_reach_is_converter_unavailable(tmp_path, monkeypatch):
    """What the fixtures turn into a skip; nothing is left in the cache."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-packages"))
    with pytest.raises(ConverterUnavailable, match="cannot download llama-cpp-python=="):
        converter_folder(tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []
