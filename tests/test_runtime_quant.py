"""QuantMatrix products against a full dequantization by gguf's reference code."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.weight_types import WEIGHT_TYPES, Kernel
from powerinfer_tools.kernels import ggml_base
from powerinfer_tools.kernels.quant import QuantMatrix

TYPES = [t.qtype for t in WEIGHT_TYPES.values() if t.has(Kernel.ARRAY_DECODE)]  # f32, f16, q8_0, q4_0
GGML_TYPES = [t.qtype for t in WEIGHT_TYPES.values() if not t.has(Kernel.ARRAY_DECODE)]  # by ggml's to_float


def make(qtype, rows, cols, seed=0) -> QuantMatrix:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    if qtype is T.F32:
        return QuantMatrix(qtype, w)
    if qtype is T.F16:
        return QuantMatrix(qtype, w.astype(np.float16))
    if qtype in GGML_TYPES:  # gguf-py has no quantizer of the k-quants: llama-quantize's
        return QuantMatrix(qtype, ggml_base.load().quantize(w, qtype))
    return QuantMatrix(qtype, quantize(w, qtype))


def full(m: QuantMatrix) -> np.ndarray:
    if m.qtype in (T.F32, T.F16):
        return m.data.astype(np.float32)
    return dequantize(m.data, m.qtype)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows,cols", [(1, 32), (7, 64), (1500, 96)])  # 1500 spans two chunks
def test_products_match_dense_reference(qtype, rows, cols):
    m = make(qtype, rows, cols)
    assert (m.rows, m.cols) == (rows, cols)
    w = full(m)
    x = np.random.default_rng(1).standard_normal((3, cols)).astype(np.float32)
    np.testing.assert_allclose(m.matmul(x), x @ w.T, rtol=1e-5, atol=1e-4)
    picked = np.random.default_rng(2).choice(rows, size=min(rows, 1100), replace=False)
    np.testing.assert_allclose(m.matmul(x, picked), x @ w[picked].T, rtol=1e-5, atol=1e-4)
    coeffs = np.random.default_rng(3).standard_normal((3, len(picked))).astype(np.float32)
    np.testing.assert_allclose(m.weighted_row_sum(coeffs, picked), coeffs @ w[picked], rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("qtype", TYPES + GGML_TYPES)
def test_dequantization_is_bit_exact_against_gguf(qtype):
    m = make(qtype, 33, 512, seed=5)
    assert np.array_equal(m.dequantize_rows(), full(m))
    assert np.array_equal(m.dequantize_rows(np.array([32, 0, 5])), full(m)[[32, 0, 5]])


@pytest.mark.parametrize("qtype", GGML_TYPES)
def test_types_without_array_decoders_dequantize_through_ggml_and_numpy_alike(qtype, monkeypatch):
    """Rows of the types that ggml's ``to_float`` dequantizes come out the same from gguf's NumPy code,
    where llama-cpp-python is missing; and the products of either are the reference's."""
    m = make(qtype, 40, 256, seed=6)
    through_ggml = m.dequantize_rows()
    monkeypatch.setattr(ggml_base, "loaded", lambda: None)
    assert np.array_equal(m.dequantize_rows(), through_ggml)
    assert (m.rows, m.cols, m.nbytes) == (40, 256, 40 * WEIGHT_TYPES[qtype].row_bytes(256))


def test_empty_row_selection_gives_empty_or_zero_results():
    m = make(T.Q4_0, 10, 64)
    x = np.ones((2, 64), dtype=np.float32)
    none = np.array([], dtype=np.int64)
    assert m.matmul(x, none).shape == (2, 0)
    assert not m.weighted_row_sum(np.zeros((2, 0), np.float32), none).any()


def test_unsupported_type_is_refused():
    with pytest.raises(ValueError, match="IQ2_XXS"):
        QuantMatrix(T.IQ2_XXS, np.zeros((2, 66), np.uint8))


@pytest.mark.parametrize("bundled", [False, True], ids=["powerinfer-layout", "bundled-layout"])
def test_an_ffn_matrix_of_a_type_the_kernels_lack_is_one_clear_error(small_powerinfer_file, tmp_path, bundled):
    """A file whose ffn_up matrices are q8_1 (a ggml type outside the runtime's table: ggml encodes x so, never
    weights)."""
    from powerinfer_tools.conversion.bundle import bundle_model
    from powerinfer_tools.formats.model_file import CopiedTensor, ModelFileWriter, copy_metadata, open_model_file
    from powerinfer_tools.formats.quantization import storage_shape
    from powerinfer_tools.runtime.loader import load_runtime_model

    source = open_model_file(small_powerinfer_file)
    path = tmp_path / "q8_1.powerinfer.gguf"
    writer = ModelFileWriter(path, source.architecture, source.powerinfer)
    copy_metadata(source, writer.gguf)
    q8_1_bytes = lambda t: np.zeros(storage_shape(t.shape, T.Q8_1)[0], np.uint8)  # noqa: E731
    writer.write([CopiedTensor(t.name, t.shape, T.Q8_1, lambda t=t: q8_1_bytes(t))
                  if t.name.endswith("ffn_up.weight") else CopiedTensor(t.name, t.shape, t.qtype, lambda t=t: t.data)
                  for t in source.tensors.values()], progress=False)
    if bundled:
        bundle_model(path, tmp_path / "q8_1.bundled.powerinfer.gguf", progress=False)
        path = tmp_path / "q8_1.bundled.powerinfer.gguf"
    for ram in (None, 10**9):
        with pytest.raises(PitoolsError, match=r"stored as Q8_1, which the runtime cannot compute with"):
            load_runtime_model(path, ram=ram)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q5_0, T.Q5_1])
def test_a_sparse_ffn_of_a_type_ggml_computes_runs_as_its_float_twin(small_powerinfer_file, tmp_path, qtype):
    """A PowerInfer file whose gate, up and ffn_down_t are ``qtype`` (the small model's rows are 32 wide: the
    k-quants' 256 take the same code, tested at kernel level) runs sparse on the general path (no axpy of
    ours decodes ``ffn_down_t``: ggml's ``to_float`` rows do) and gives the logits of its twin that stores
    those matrices as their dequantized values in f32, up to the q8 encoding of x in the gate and up
    products (~0.5% a product, compounded over the layers and positions of this random model: measured
    1.5-2.0% on the logits; half the 0.1 llama.cpp's q4_0 logits may be from the float reference)."""
    from gguf_fixtures import relative_error, stepwise_logits

    from powerinfer_tools.formats.model_file import CopiedTensor, ModelFileWriter, copy_metadata, open_model_file
    from powerinfer_tools.interfaces import FFNMode
    from powerinfer_tools.runtime.loader import load_runtime_model

    source = open_model_file(small_powerinfer_file)
    is_ffn = lambda name: name.endswith(("ffn_gate.weight", "ffn_up.weight", "ffn_down_t.weight"))  # noqa: E731
    stored = {name: ggml_base.load().quantize(t.dequantize(), qtype) for name, t in source.tensors.items()
              if is_ffn(name)}
    logits = []
    for name, as_type in (("quantized", qtype), ("twin", T.F32)):
        path = tmp_path / f"{name}.powerinfer.gguf"
        writer = ModelFileWriter(path, source.architecture, source.powerinfer)
        copy_metadata(source, writer.gguf)
        writer.write([CopiedTensor(t.name, t.shape, as_type, lambda t=t: stored[t.name] if as_type is qtype
                                   else WEIGHT_TYPES[qtype].dequantize(stored[t.name]))
                      if is_ffn(t.name) else CopiedTensor(t.name, t.shape, t.qtype, lambda t=t: t.data)
                      for t in source.tensors.values()], progress=False)
        model = load_runtime_model(path)
        model.mode = FFNMode.SPARSE
        logits.append(stepwise_logits(model))
        assert 0 < model.stats.neurons_active < model.stats.neurons_total
        assert (model.compiled_decoder() is None) == (as_type is qtype)  # the twin's f32 rows take the axpy
    assert relative_error(*logits) < 0.05
