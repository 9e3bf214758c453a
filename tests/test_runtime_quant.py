"""QuantMatrix products against a full dequantization by gguf's reference code."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.kernels.quant import QuantMatrix

TYPES = [T.F32, T.F16, T.Q8_0, T.Q4_0]


def make(qtype, rows, cols, seed=0) -> QuantMatrix:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    if qtype is T.F32:
        return QuantMatrix(qtype, w)
    if qtype is T.F16:
        return QuantMatrix(qtype, w.astype(np.float16))
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


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantization_is_bit_exact_against_gguf(qtype):
    m = make(qtype, 33, 128, seed=5)
    assert np.array_equal(m.dequantize_rows(), full(m))
    assert np.array_equal(m.dequantize_rows(np.array([32, 0, 5])), full(m)[[32, 0, 5]])


def test_empty_row_selection_gives_empty_or_zero_results():
    m = make(T.Q4_0, 10, 64)
    x = np.ones((2, 64), dtype=np.float32)
    none = np.array([], dtype=np.int64)
    assert m.matmul(x, none).shape == (2, 0)
    assert not m.weighted_row_sum(np.zeros((2, 0), np.float32), none).any()


def test_unsupported_type_is_refused():
    with pytest.raises(ValueError, match="Q5_K"):
        QuantMatrix(T.Q5_K, np.zeros((2, 176), np.uint8))


@pytest.mark.parametrize("bundled", [False, True], ids=["powerinfer-layout", "bundled-layout"])
def test_an_ffn_matrix_of_a_type_the_kernels_lack_is_one_clear_error(small_powerinfer_file, tmp_path, bundled):
    """A file whose ffn_up matrices are q5_0 (PowerInfer's quantizer writes it; our kernels do not compute it)."""
    from powerinfer_tools.conversion.bundle import bundle_model
    from powerinfer_tools.formats.model_file import CopiedTensor, ModelFileWriter, copy_metadata, open_model_file
    from powerinfer_tools.formats.quantization import encode
    from powerinfer_tools.runtime.loader import load_runtime_model

    source = open_model_file(small_powerinfer_file)
    path = tmp_path / "q5.powerinfer.gguf"
    writer = ModelFileWriter(path, source.architecture, source.powerinfer)
    copy_metadata(source, writer.gguf)
    writer.write([CopiedTensor(t.name, t.shape, T.Q5_0, lambda t=t: encode(t.dequantize(), T.Q5_0))
                  if t.name.endswith("ffn_up.weight") else CopiedTensor(t.name, t.shape, t.qtype, lambda t=t: t.data)
                  for t in source.tensors.values()], progress=False)
    if bundled:
        bundle_model(path, tmp_path / "q5.bundled.powerinfer.gguf", progress=False)
        path = tmp_path / "q5.bundled.powerinfer.gguf"
    for ram in (None, 10**9):
        with pytest.raises(PitoolsError, match=r"stored as Q5_0, which the runtime cannot compute with"):
            load_runtime_model(path, ram=ram)
