"""Predictors computed from their stored type (f32, f16, q8_0, q4_0) against PowerInfer's rule in float32.

The reference is ``formats.predictor_rule.predict`` on the dequantized weights. On the CPU the kernels
encode the input as ggml's ``vec_dot`` wants it (q8_0 for quantized rows, f16 for f16 rows), as
llama.cpp and PowerInfer do, so scores move by that rounding and a neuron whose score is that close to
the threshold may flip: the tests bound every score's error by the rounding and count the flips.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import MODEL_TENSOR, GGMLQuantizationType as Q
from gguf_fixtures import TOKENS, make_model, relative_error, save_predictors, stepwise_logits

from powerinfer_tools import kernels
from powerinfer_tools.conversion.convert import convert
from powerinfer_tools.formats.constants import predictor_names, tensor_name
from powerinfer_tools.formats.gpu_split import GpuSplit, write_gpu_split
from powerinfer_tools.formats.model_file import open_model_file
from powerinfer_tools.formats.predictor_rule import predict
from powerinfer_tools.formats.quantization import decode, encode, tensor_type
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.kernels.quant import QuantMatrix
from powerinfer_tools.runtime.backends import CpuBackend, EmulatedDevice
from powerinfer_tools.runtime.ffn import Predictor
from powerinfer_tools.runtime.loader import load_runtime_model

D_MODEL, HIDDEN, D_FF = 256, 64, 1024
TYPES = (Q.F32, Q.F16, Q.Q8_0, Q.Q4_0)


def stored(w: np.ndarray, qtype: Q) -> QuantMatrix:
    return QuantMatrix(qtype, w.astype(np.float16) if qtype is Q.F16 else encode(w, qtype))


def random_predictor(fc1_type: Q, fc2_type: Q, backend, seed: int = 0) -> Predictor:
    rng = np.random.default_rng(seed)
    fc1 = rng.standard_normal((HIDDEN, D_MODEL)).astype(np.float32) / np.sqrt(D_MODEL)
    fc2 = rng.standard_normal((D_FF, HIDDEN)).astype(np.float32) / np.sqrt(HIDDEN)
    fc2[:, 0] -= 0.5  # a bias through the first hidden unit, so that fewer than half the neurons fire
    fc1[0] = np.abs(fc1[0])
    fc1_m, fc2_m = stored(fc1, fc1_type), stored(fc2, fc2_type)
    if backend.is_device:
        fc1_m, fc2_m = (QuantMatrix(m.qtype, backend.upload(m.data)) for m in (fc1_m, fc2_m))
    return Predictor(backend, fc1_m, fc2_m)


def encoded(v: np.ndarray, weight_type: Q) -> np.ndarray:
    """``v`` as ggml's ``vec_dot`` sees it beside rows of ``weight_type``: q8_0-rounded for quantized rows,
    f16-rounded for f16 rows (gguf's reference quantizer: ggml's SIMD one may round a tie the other way)."""
    if weight_type is Q.F32:
        return v
    if weight_type is Q.F16:
        return v.astype(np.float16).astype(np.float32)
    return decode(encode(v, Q.Q8_0), Q.Q8_0)


def encodes(m: QuantMatrix, n_tokens: int) -> bool:
    """Whether the CPU's product of ``n_tokens`` with ``m`` encodes them: the kernels do for a few tokens, and
    for a block ggml's GEMM on an interleaved copy of a q4_0 matrix does (``CpuBackend.matmul``); bfloat16
    products (``in_bfloat16``), dequantize + BLAS, and the NumPy reference, encode nothing."""
    return kernels.available() and (n_tokens <= kernels.MAX_TOKENS or kernels.interleaves(m))


def in_bfloat16(m: QuantMatrix, n_tokens: int) -> bool:
    """Whether the CPU multiplies a block of ``n_tokens`` with ``m`` in bfloat16 (``kernels.bf16_matmul``)."""
    return n_tokens > kernels.MAX_TOKENS and not kernels.interleaves(m) and kernels.bf16_matmuls(m)


def bfloat16(v: np.ndarray) -> np.ndarray:
    """``v`` rounded to bfloat16 (to nearest even), as float32."""
    bits = np.ascontiguousarray(v, dtype=np.float32).view(np.uint32)
    return ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) & np.uint32(0xFFFF0000)).view(np.float32)


def rule_on_encoded_inputs(p: Predictor, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The scores computed in float64 from inputs encoded as the CPU's products encode them (``encodes``), and
    the sum of the magnitudes of their terms (the scale of float32 summation error)."""
    n = len(x)
    fc1, fc2 = (m.dequantize_rows() for m in (p.fc1, p.fc2))
    fc1, fc2 = ((bfloat16(w) if in_bfloat16(m, n) else w).astype(np.float64) for w, m in ((fc1, p.fc1), (fc2, p.fc2)))

    def enc(v: np.ndarray, m: QuantMatrix) -> np.ndarray:
        if in_bfloat16(m, n):
            return bfloat16(v)
        return encoded(v, m.qtype) if encodes(m, n) else v

    hidden = np.maximum(enc(x, p.fc1) @ fc1.T, 0).astype(np.float32)
    hidden = enc(hidden, p.fc2).astype(np.float64)
    return hidden @ fc2.T, hidden @ np.abs(fc2).T


def residuals(n_tokens: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n_tokens, D_MODEL)).astype(np.float32)


@pytest.mark.parametrize("fc1_type", TYPES)
@pytest.mark.parametrize("fc2_type", TYPES)
@pytest.mark.parametrize("n_tokens", [8, 64])  # decoding (the kernels) and a prompt block (rows in bfloat16 or BLAS)
def test_cpu_predictor_from_stored_type_agrees_with_float32_rule(fc1_type, fc2_type, n_tokens):
    p = random_predictor(fc1_type, fc2_type, CpuBackend())
    x = residuals(n_tokens)
    fc1, fc2 = p.fc1.dequantize_rows(), p.fc2.dequantize_rows()
    reference = predict(fc1, fc2, x)
    assert 0.1 < reference.mean() < 0.6  # neither side of the threshold is empty
    scores = p.scores(x)
    emulated, magnitude = rule_on_encoded_inputs(p, x)
    assert np.all(np.abs(scores - emulated) <= 1e-5 * magnitude + 1e-6)
    # Against the float32 rule: scores move by the input's rounding only, and so do the decisions.
    exact = np.maximum(x @ fc1.T, 0) @ fc2.T
    worst = {Q.F32: 1e-5, Q.F16: 1e-3, Q.Q8_0: 0.01, Q.Q4_0: 0.01}
    allowed = max(0.01 if in_bfloat16(m, n_tokens) else worst[m.qtype] if encodes(m, n_tokens) else 1e-5
                  for m in (p.fc1, p.fc2))
    assert np.sqrt(np.mean((scores - exact) ** 2)) <= allowed * np.sqrt(np.mean(exact**2))
    flipped = p(x) != reference
    moved_across = (emulated >= 0) != (exact >= 0)
    near = np.abs(exact) <= 1e-4 * magnitude + 1e-6
    assert np.all(moved_across[flipped] | near[flipped])  # only where the rounding moved the score across 0
    assert flipped.mean() <= 0.01, f"{flipped.sum()} of {flipped.size} decisions differ from the float32 rule"


@pytest.mark.parametrize("qtype", TYPES)
def test_device_predictor_computes_the_float32_rule_on_its_stored_rows(qtype):
    """The (emulated) device has no vec_dot: it dequantizes a chunk of rows at a time and multiplies in float32."""
    device = EmulatedDevice(10**9)
    p = random_predictor(qtype, qtype, device)
    assert device.used_bytes == p.nbytes  # the stored bytes were uploaded, not a float32 copy
    x = residuals(5)
    fc1, fc2 = p.fc1.dequantize_rows(), p.fc2.dequantize_rows()
    np.testing.assert_allclose(p.scores(x), np.maximum(x @ fc1.T, 0) @ fc2.T, rtol=1e-5, atol=1e-5)
    assert np.array_equal(p(x), predict(fc1, fc2, x))


LLAMA = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=64, hidden_act="relu")


@pytest.fixture(scope="module")
def q4_0_models(tmp_path_factory):
    """hidden size -> a q4_0 PowerInfer file with random predictors of that size: 32 stores fc2 as q4_0,
    12 and 16 (rows not a whole q4_0 block) as f16; 16 is narrow f16 rows the compiled path takes without
    ggml (``numba_kernels.f16_row_dot``)."""
    root = tmp_path_factory.mktemp("predictor-storage")
    make_model(root / "model", "llama", **LLAMA)
    files = {}
    for hidden in (12, 16, 32):
        rng = np.random.default_rng(hidden)
        layers = [(rng.standard_normal((hidden, 64)).astype(np.float32),
                   rng.standard_normal((160, hidden)).astype(np.float32)) for _ in range(2)]
        save_predictors(root / f"pred{hidden}", layers)
        files[hidden], _ = convert(str(root / "model"), root / f"m{hidden}.gguf", outtype="q4_0",
                                   predictors=root / f"pred{hidden}", progress=False)
    return files


@pytest.mark.parametrize("hidden,fc2_type", [(12, Q.F16), (32, Q.Q8_0)])  # fc2: PREDICTOR_TYPES
def test_runtime_keeps_predictors_in_their_stored_type_and_counts_those_bytes(q4_0_models, hidden, fc2_type):
    path = q4_0_models[hidden]
    stored_file = open_model_file(path)
    model = load_runtime_model(path)
    for i, layer in enumerate(model.layers):
        p = layer.dense.predictor
        assert (p.fc1.qtype, p.fc2.qtype) == (Q.Q4_0, fc2_type)
        for m, name in zip((p.fc1, p.fc2), predictor_names(i)):
            assert m.nbytes == stored_file[name].nbytes
    float32_bytes = sum(4 * (hidden * 64 + 160 * hidden) for _ in model.layers)
    plans = model.ffn_plans[FFNMode.SPARSE]  # what a sparse step reads of each layer's FFN
    assert [plan.predictor_bytes for plan in plans] == [(layer.dense.predictor.nbytes,) for layer in model.layers]
    predictor_bytes = sum(layer.dense.predictor.nbytes for layer in model.layers)
    assert predictor_bytes == sum(stored_file[name].nbytes for i in range(len(model.layers))
                                  for name in predictor_names(i)) < float32_bytes / 2
    model.mode = FFNMode.SPARSE
    caches = model.new_cache()
    model.forward(TOKENS[:1], caches)
    step = model.stats
    p = model.layers[0].partitions[0]
    neuron_bytes = step.neurons_active * (p.gate.row_bytes + p.up.row_bytes + p.down_t.row_bytes)
    assert step.bytes_read == model.static_bytes + predictor_bytes + neuron_bytes


def test_device_holds_the_predictors_at_their_stored_size(q4_0_models, tmp_path):
    """What the solver budgets for a layer's dense block on the GPU (solver/model_stats.py: stored sizes)
    is what the runtime uploads."""
    path = q4_0_models[32]
    stored_file = open_model_file(path)
    split = tmp_path / "m.gpuidx"
    no_neurons = tuple(np.zeros(160, bool) for _ in range(2))
    write_gpu_split(split, GpuSplit(no_neurons, vram_capacity=10**9, dense_on_gpu=(True, True)))
    model = load_runtime_model(path, split=split)
    dense_parts = (MODEL_TENSOR.ATTN_NORM, MODEL_TENSOR.ATTN_Q, MODEL_TENSOR.ATTN_K, MODEL_TENSOR.ATTN_V,
                   MODEL_TENSOR.ATTN_OUT, MODEL_TENSOR.FFN_NORM)
    names = [tensor_name(part, i) for i in range(2) for part in dense_parts] + [
        name for i in range(2) for name in predictor_names(i)]
    assert model.device.used_bytes == sum(stored_file[name].nbytes for name in names)
    assert all(layer.dense.predictor.backend is model.device for layer in model.layers)


def assert_same_sparse_decoding(compiled, general) -> None:
    """The compiled decoder and the general path choose the same neurons and give the same logits, up to float32
    summation order, decoding in sparse mode."""
    logits = []
    for model in (compiled, general):
        model.mode = FFNMode.SPARSE
        logits.append(stepwise_logits(model))
    assert 0 < compiled.stats.neurons_active < compiled.stats.neurons_total
    assert compiled.stats.neurons_active == general.stats.neurons_active
    assert relative_error(*logits) < 1e-4


@pytest.mark.skipif(not kernels.available(), reason=f"compiled kernels unavailable: {kernels.unavailable_reason()}")
@pytest.mark.parametrize("hidden", [12, 16, 32])
def test_compiled_decoder_predicts_what_the_general_path_predicts(q4_0_models, hidden):
    """Both call ggml's vec_dot on the stored rows with the same encoded inputs; they differ only in the float32
    summation order of the rest of the layer."""
    compiled, general = load_runtime_model(q4_0_models[hidden]), load_runtime_model(q4_0_models[hidden])
    general.compiled_decoding = False
    assert compiled.compiled_decoder() is not None
    assert_same_sparse_decoding(compiled, general)


def test_q5_0_predictors_are_computed_as_stored(q4_0_models, tmp_path, monkeypatch):
    """PowerInfer's own quantizer writes q5_0 predictors into non-q4_0 models: they stay q5_0, computed by
    ggml's ``vec_dot`` with x as q8_0 (as PowerInfer's ggml_mul_mat computes them), by the compiled decoder
    and the general path alike."""
    import powerinfer_tools.conversion.convert as conversion

    predictor_tensors = set(predictor_names(0) + predictor_names(1))

    def q5_0_predictors(name, shape, outtype, *, is_output):
        return Q.Q5_0 if name in predictor_tensors else tensor_type(name, shape, outtype, is_output=is_output)

    monkeypatch.setattr(conversion, "tensor_type", q5_0_predictors)
    source = open_model_file(q4_0_models[32])
    folder = tmp_path / "pred"
    save_predictors(folder, [tuple(source[name].dequantize() for name in predictor_names(i)) for i in range(2)])
    path, _ = convert(str(q4_0_models[32].parent / "model"), tmp_path / "q5.gguf", outtype="q4_0",
                      predictors=folder, progress=False)
    stored_file = open_model_file(path)
    compiled, general = load_runtime_model(path), load_runtime_model(path)
    general.compiled_decoding = False
    for i, layer in enumerate(compiled.layers):
        p = layer.dense.predictor
        for m, name in zip((p.fc1, p.fc2), predictor_names(i)):
            assert stored_file[name].qtype is Q.Q5_0 and m.qtype is Q.Q5_0
            assert np.array_equal(m.dequantize_rows(), stored_file[name].dequantize())
    assert compiled.compiled_decoder() is not None
    assert_same_sparse_decoding(compiled, general)
