"""Dense files in llama.cpp (through llama-cpp-python) against our reference engine."""

from __future__ import annotations

import ctypes
import dataclasses

import llama_cpp
import numpy as np
import pytest
from gguf_fixtures import SAMPLE_TEXTS, llama, make_model, rope_rows
from powerinfer_tools.formats.model_file import open_model_file
from tokenizers import Tokenizer

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.conversion.convert import convert
from powerinfer_tools.models import FFNKind, load_model

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, hidden_act="silu")
MODELS = {
    "llama": ("llama", dict(BASE, rope_theta=500.0)),
    "mistral": ("mistral", dict(BASE, tie_word_embeddings=True, sliding_window=None)),
    "llama-bias": ("llama", dict(BASE, attention_bias=True, mlp_bias=True)),
    "relu-llama": ("llama", dict(BASE, hidden_act="relu")),
    "mixtral": ("mixtral", dict(BASE, num_local_experts=3, num_experts_per_tok=2, sliding_window=None)),
    # llama.cpp's "qwen2": q/k/v biases, and neox rope on q/k rows in the checkpoint's order
    "qwen2": ("qwen2", dict(BASE, rope_theta=500.0)),
    "qwen2-tied": ("qwen2", dict(BASE, tie_word_embeddings=True)),
}
GGUF_ARCHITECTURE = {"qwen2": "qwen2", "qwen2-tied": "qwen2"}  # the others are "llama"
PROMPT = SAMPLE_TEXTS[1]
GENERATED = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    for name, (family, config) in MODELS.items():
        make_model(root / name, family, **config)
    return root


def tokens(folder) -> np.ndarray:
    return np.array(Tokenizer.from_file(str(folder / "tokenizer.json")).encode(PROMPT).ids)


def cpp_logits(path, ids):
    """llama.cpp's logits at every position of ``ids``, and the Llama object to continue with."""
    # f32 KV cache: llama.cpp's default f16 cache alone costs ~1e-3 relative error.
    llm = llama(path, n_ctx=256, logits_all=True, n_threads=2, type_k=0, type_v=0)
    llm.eval(ids.tolist())
    return np.array(llm.scores[: len(ids)], dtype=np.float64), llm


def relative_error(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def dequantized_reference(folder, path):
    """Our engine with the weights as stored in the GGUF file (dequantized; q/k rows put back where
    llama.cpp's "normal" rope of "llama" wants them regrouped)."""
    model = load_model(Checkpoint(folder))
    f = open_model_file(path)
    s = model.spec

    def w(name):
        return f[name].dequantize()

    def unrope(name, heads):
        rows = w(name)
        return rows[np.argsort(rope_rows(len(rows), heads))] if f.architecture == "llama" else rows

    model.embed, model.lm_head = w("token_embd.weight"), w("output.weight")
    for i, b in enumerate(model.blocks):
        b.wq, b.wk = unrope(f"blk.{i}.attn_q.weight", s.n_heads), unrope(f"blk.{i}.attn_k.weight", s.n_kv_heads)
        b.wv, b.wo = w(f"blk.{i}.attn_v.weight"), w(f"blk.{i}.attn_output.weight")
        if s.moe:
            b.ffn.router = w(f"blk.{i}.ffn_gate_inp.weight")
            stacked = [w(f"blk.{i}.ffn_{p}_exps.weight") for p in ("gate", "up", "down")]
            for expert, (gate, up, down) in zip(b.ffn.experts, zip(*stacked)):
                expert.gate, expert.up, expert.down = gate, up, down
        else:
            b.ffn.gate, b.ffn.up, b.ffn.down = (w(f"blk.{i}.ffn_{p}.weight") for p in ("gate", "up", "down"))
    return model


@pytest.mark.parametrize("name", ["llama", "mistral", "llama-bias", "mixtral", "qwen2", "qwen2-tied"])
@pytest.mark.parametrize("outtype, tolerance", [("f32", 1e-4), ("f16", 1e-2)])
def test_silu_logits_and_greedy_tokens_match(tmp_path, models, name, outtype, tolerance):
    folder = models / name
    path, plan = convert(str(folder), tmp_path / "m.gguf", outtype=outtype, progress=False)
    assert plan.architecture == GGUF_ARCHITECTURE.get(name, "llama") and not plan.powerinfer
    ids = tokens(folder)
    original = load_model(Checkpoint(folder))
    got, llm = cpp_logits(path, ids)
    assert relative_error(got, original.forward(ids, original.new_cache())) < tolerance

    # Top-1 and greedy decoding against our engine on the weights as stored (f16-rounded for f16).
    # f16 leaves llama.cpp ~1e-3 of noise (it rounds activations to f16 too): positions where the
    # reference's best two logits are closer than that are genuine ties and are not compared.
    model = dequantized_reference(folder, path)
    cache = model.new_cache()
    want = model.forward(ids, cache).astype(np.float64)
    best_two = np.sort(want, axis=1)[:, -2:]
    decided = best_two[:, 1] - best_two[:, 0] > (0 if outtype == "f32" else 1e-2)
    assert decided.mean() > 0.9
    assert np.array_equal(got.argmax(axis=1)[decided], want.argmax(axis=1)[decided])

    ours, theirs = [], []
    last_ours, last_theirs = want[-1], got[-1]
    for _ in range(GENERATED):
        ours.append(int(last_ours.argmax()))
        theirs.append(int(last_theirs.argmax()))
        last_ours = model.forward(np.array(ours[-1:]), cache)[-1]
        llm.eval(theirs[-1:])
        last_theirs = np.array(llm.scores[llm.n_tokens - 1])
    assert theirs == ours


def test_relu_model_in_dense_mode_runs_silu_in_llamacpp(tmp_path, models):
    """llama.cpp's "llama" has no ReLU FFN: it computes the same weights with SiLU."""
    folder = models / "relu-llama"
    path, _ = convert(str(folder), tmp_path / "m.gguf", outtype="f32", dense=True, progress=False)
    assert open_model_file(path).get("pitools.ffn_activation") == "reglu"
    ids = tokens(folder)
    model = load_model(Checkpoint(folder))
    assert model.spec.ffn is FFNKind.REGLU
    model.spec = dataclasses.replace(model.spec, ffn=FFNKind.SWIGLU)
    got, _ = cpp_logits(path, ids)
    assert relative_error(got, model.forward(ids, model.new_cache())) < 1e-4


@pytest.mark.parametrize("name", ["llama", "mixtral", "qwen2"])
@pytest.mark.parametrize("outtype", ["q8_0", "q4_0"])
def test_quantized_files_compute_what_they_store(tmp_path, models, name, outtype):
    """llama.cpp on a quantized file agrees with our engine on the dequantized weights; what is left
    is llama.cpp's own rounding of activations to q8_0 inside its quantized dot products."""
    folder = models / name
    path, _ = convert(str(folder), tmp_path / "m.gguf", outtype=outtype, progress=False)
    ids = tokens(folder)
    model = dequantized_reference(folder, path)
    got, _ = cpp_logits(path, ids)
    assert relative_error(got, model.forward(ids, model.new_cache())) < 0.1


@pytest.mark.parametrize("name", ["llama", "mixtral"])
@pytest.mark.parametrize("outtype, ftype", [("q8_0", 7), ("q4_0", 2)])
def test_quantization_is_llama_quantize_bit_for_bit(tmp_path, models, name, outtype, ftype):
    """Our q8_0/q4_0 files hold exactly what llama.cpp's own quantizer makes of our f32 file (the
    router of a mixture stays f32 in both)."""
    folder = models / name
    f32, _ = convert(str(folder), tmp_path / "f32.gguf", outtype="f32", progress=False)
    ours, _ = convert(str(folder), tmp_path / "ours.gguf", outtype=outtype, progress=False)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    theirs = tmp_path / "theirs.gguf"
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(theirs).encode(), ctypes.byref(params)) == 0
    a, b = open_model_file(ours), open_model_file(theirs)
    assert set(a.tensors) == set(b.tensors)
    for name, t in a.tensors.items():
        assert t.qtype is b[name].qtype, name
        assert np.array_equal(t.data, b[name].data), name
