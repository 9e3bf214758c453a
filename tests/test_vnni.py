"""q4_0 row products with AVX-512 VNNI (kernels/numba_vnni.py): the kernel against a NumPy reference,
and the runtime's sparse FFN computing with it what it computes with ggml's ``vec_dot``.

Skipped, with the reason, on a CPU without AVX-512 VNNI/VBMI (the runtime then never takes this path).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from numba import njit

from powerinfer_tools import kernels
from powerinfer_tools.benchmarking.synth import Planting, Shape, synthesize
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.kernels import numba_kernels as nk
from powerinfer_tools.kernels import numba_vnni
from powerinfer_tools.runtime.loader import load_runtime_model

pytestmark = pytest.mark.skipif(not (kernels.available() and numba_vnni.available()),
                                reason="this CPU lacks AVX-512 VNNI/VBMI (or the compiled kernels are unavailable)")


@njit
def _products(from_float, weights, x, x_q8_0, x_vnni, out):
    """Every row of ``weights`` (q4_0 bytes) times ``x``, through ggml's q8_0 encoding and ``row_dot``."""
    cols = x.shape[0]
    nk.ggml_from_float(from_float, x.ctypes.data, x_q8_0.ctypes.data, cols)
    numba_vnni.encode(x_q8_0, x_vnni, cols // numba_vnni.GROUP_COLS)
    for i in range(weights.shape[0]):
        row = weights.ctypes.data + i * weights.strides[0]
        out[i] = numba_vnni.row_dot(row, x_vnni.ctypes.data, cols // numba_vnni.GROUP_COLS, row)


def _row_dot_all(w_q4_0: np.ndarray, x: np.ndarray) -> np.ndarray:
    routine = kernels.ggml_routines().routines[Q.Q4_0]
    out = np.empty(w_q4_0.shape[0], np.float32)
    _products(routine.from_float, w_q4_0, x, np.zeros(routine.encoded_bytes(len(x)), np.uint8),
              np.zeros(numba_vnni.encoded_bytes(len(x)), np.uint8), out)
    return out


@pytest.mark.parametrize("cols", [128, 384, 2048])
def test_row_dot_is_the_product_with_x_as_q8_0(cols):
    """Against float64 NumPy on gguf's own dequantization of the weights and of x's q8_0 encoding: equal
    up to float32 summation order. Rows include the extremes: every nibble 0 or 15 with large scales,
    and a zero row."""
    rng = np.random.default_rng(cols)
    w = quantize(rng.standard_normal((37, cols)).astype(np.float32), Q.Q4_0)
    w[0].reshape(-1, 18)[:, 2:] = 0x00  # nibble 0: weight -8 x scale
    w[1].reshape(-1, 18)[:, 2:] = 0xFF  # nibble 15: weight 7 x scale
    w[:2].reshape(2, -1, 18)[:, :, :2] = np.full((2, cols // 32, 1), 3.5, np.float16).view(np.uint8)
    w[2] = 0
    x = rng.standard_normal(cols).astype(np.float32) * np.where(np.arange(cols) % 97 == 0, 40, 1).astype(np.float32)
    got = _row_dot_all(w, x)
    weights = dequantize(w, Q.Q4_0).astype(np.float64)
    seen = dequantize(quantize(x[None], Q.Q8_0), Q.Q8_0)[0].astype(np.float64)
    want = weights @ seen
    scale = np.abs(weights) @ np.abs(seen)
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-30)
    assert got[2] == 0


def test_only_q4_0_rows_a_whole_number_of_groups_wide_take_it():
    assert numba_vnni.usable(128) and numba_vnni.usable(4096)
    assert not numba_vnni.usable(64) and not numba_vnni.usable(96)


@pytest.fixture(scope="module")
def wide_tiny(tmp_path_factory):
    """A q4_0 model 128 wide (synth's test-tiny is 64: too narrow for groups of four blocks)."""
    from gguf_fixtures import FAST_TRAINING

    out = tmp_path_factory.mktemp("vnni") / "wide.powerinfer.gguf"
    shape = Shape(128, 384, 2, 4, 2, vocab_size=4096, context=128)
    return synthesize(shape, out, "q4_0", Planting(density=0.1), profile_tokens=1280, train=FAST_TRAINING,
                      progress=False).powerinfer


@njit
def _takes_vnni(w) -> bool:  # a LayerWeights' field, read in compiled code (the proxy has no attributes)
    return w.vnni


def _steps(model, tokens) -> np.ndarray:
    caches = model.new_cache()
    return np.concatenate([model.forward(tokens[i : i + 1], caches) for i in range(len(tokens))])


@pytest.mark.parametrize("mode,ram", [(FFNMode.SPARSE, False), (FFNMode.DENSE, False), (FFNMode.SPARSE, True)])
def test_the_runtime_computes_with_it_what_it_computes_with_vec_dot(wide_tiny, monkeypatch, mode, ram):
    """Decoded tokens (the compiled path, whose gate/up rows take ``row_dot``): the same neurons, logits
    within float32 summation order; also under a RAM budget, where the rows are a neuron cache's."""
    tokens = np.random.default_rng(2).integers(0, 4096, 10)
    budget = os.path.getsize(wide_tiny) - 80 * 1024 if ram else None  # about half of the FFN rows resident

    def decoded(vnni: bool):
        monkeypatch.setattr(numba_vnni, "available", lambda: vnni)
        model = load_runtime_model(wide_tiny, ram=budget)
        model.mode = mode
        decoder = model.compiled_decoder()
        assert decoder is not None and all(_takes_vnni(w) == vnni for w in decoder.layers)
        return _steps(model, tokens), model.stats

    (steps, stats), (want, want_stats) = decoded(True), decoded(False)
    assert stats == want_stats
    np.testing.assert_allclose(steps, want, rtol=0, atol=1e-5 * np.abs(want).max())
