"""Dense files in llama.cpp (through llama-cpp-python) against our reference engine."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from cli_checks import invoke
from gguf_fixtures import LLAMA_FILE_TYPES, SAMPLE_TEXTS, llama, llama_quantize, make_model, rope_rows, stepwise_logits
from powerinfer_tools.formats.gguf_spec import architecture_ffn
from powerinfer_tools.formats.model_file import open_model_file
from tokenizers import Tokenizer

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.conversion.convert import convert
from powerinfer_tools.formats.weight_types import WEIGHT_TYPES
from powerinfer_tools.models import FFNKind, load_model
from powerinfer_tools.runtime.loader import load_runtime_model

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


def test_relu_model_in_dense_mode_runs_silu_in_llamacpp_as_convert_says(tmp_path, models):
    """llama.cpp's "llama" has no ReLU FFN: it computes the same weights with SiLU, what `convert --dense` notes."""
    folder, path = models / "relu-llama", tmp_path / "m.gguf"
    result = invoke("convert", folder, "-o", path, "--outtype", "f32", "--dense")
    assert result.exit_code == 0, result.stderr
    assert [line for line in result.stderr.splitlines() if "llama.cpp" in line] == [
        "note: llama.cpp computes the FFN of a llama file with SiLU (swiglu), not with this model's ReLU (reglu): "
        "there it runs as another model; our runtime reads reglu from pitools.ffn_activation"]
    stored = open_model_file(path)
    assert stored.get("pitools.ffn_activation") == "reglu"
    ids = tokens(folder)
    model = load_model(Checkpoint(folder))
    assert model.spec.ffn is FFNKind.REGLU
    reglu = model.forward(ids, model.new_cache())
    model.spec = dataclasses.replace(model.spec, ffn=architecture_ffn(model.spec.architecture, stored.architecture,
                                                                               stored.powerinfer))
    got, _ = cpp_logits(path, ids)
    assert relative_error(got, model.forward(ids, model.new_cache())) < 1e-4 < 1e-2 < relative_error(got, reglu)


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
@pytest.mark.parametrize("outtype, file_type", [("q8_0", "Q8_0"), ("q4_0", "Q4_0")])
def test_quantization_is_llama_quantize_bit_for_bit(tmp_path, models, name, outtype, file_type):
    """Our q8_0/q4_0 files hold exactly what llama.cpp's own quantizer makes of our f32 file (the
    router of a mixture stays f32 in both)."""
    folder = models / name
    f32, _ = convert(str(folder), tmp_path / "f32.gguf", outtype="f32", progress=False)
    ours, _ = convert(str(folder), tmp_path / "ours.gguf", outtype=outtype, progress=False)
    theirs = llama_quantize(f32, tmp_path / "theirs.gguf", file_type)
    a, b = open_model_file(ours), open_model_file(theirs)
    assert set(a.tensors) == set(b.tensors)
    for name, t in a.tensors.items():
        assert t.qtype is b[name].qtype, name
        assert np.array_equal(t.data, b[name].data), name


# Every weight type a llama.cpp quantization leaves in the file must be one the runtime computes; k-quants
# need rows that are whole 256-value super-blocks, hence these widths. (llama.cpp picks the types per tensor:
# Q4_K_M keeps the head and half the layers' attn_v and ffn_down in q6_K, Q5_K_M likewise.)
K_QUANT_MODEL = dict(BASE, hidden_size=256, intermediate_size=512)


@pytest.fixture(scope="module")
def k_quant_model(tmp_path_factory):
    """(checkpoint folder, its dense f32 GGUF as ``pitools convert --dense`` writes it)."""
    root = tmp_path_factory.mktemp("k-quant")
    make_model(root / "model", "llama", **K_QUANT_MODEL)
    path, _ = convert(str(root / "model"), root / "f32.gguf", outtype="f32", dense=True, progress=False)
    return root / "model", path


@pytest.mark.parametrize("file_type", LLAMA_FILE_TYPES)
def test_runtime_computes_llama_quantize_files_as_llama_cpp_does(tmp_path, k_quant_model, file_type):
    """Our runtime on a file of llama.cpp's own quantizer gives llama.cpp's logits: both call ggml's vec_dot on
    the same rows with x encoded as the type's vec_dot_type (q8_0, q8_1, q8_K). What is left is float32
    summation order, which this random model amplifies wherever it flips the rounding of an encoded x value:
    llama.cpp's own logits of a prompt evaluated at once and token by token differ by 0.8-1.0% (Q6_K,
    Q4_K_M), and ours lie within that of one or the other (measured: 0.0000-0.011). The bound, 0.05, is half
    the 0.1 that llama.cpp's q4_0 logits are allowed from the dequantized reference above. The compiled
    one-token path takes every one of these files (Q4_K_M's q6_K attn_v beside q4_K q/k: one vec_dot partner,
    q8_K) and agrees with the general path as closely."""
    folder, f32 = k_quant_model
    path = llama_quantize(f32, tmp_path / f"{file_type}.gguf", file_type)
    stored = {t.qtype for t in open_model_file(path).tensors.values()}
    assert stored - {GGMLQuantizationType.F32} <= set(WEIGHT_TYPES), stored
    assert not stored <= {GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0}
    ids = tokens(folder)
    want, _ = cpp_logits(path, ids)
    model = load_runtime_model(path)
    assert model.compiled_decoder() is not None
    got = stepwise_logits(model, ids)
    assert relative_error(got, want) < 0.05
    model.compiled_decoding = False
    assert relative_error(stepwise_logits(model, ids), got) < 0.05
