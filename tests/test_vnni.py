"""q4_0/q8_0 row products with AVX-512 VNNI (kernels/numba_vnni.py): the kernel against a NumPy
reference, and the runtime computing with it what it computes with ggml's ``vec_dot``.

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
from powerinfer_tools.kernels.quant import QuantMatrix
from powerinfer_tools.runtime.loader import load_runtime_model

pytestmark = pytest.mark.skipif(not (kernels.available() and numba_vnni.available()),
                                reason="this CPU lacks AVX-512 VNNI/VBMI (or the compiled kernels are unavailable)")


def _row_dots(qtype: Q, weights: np.ndarray, x: np.ndarray, threads: int = 2) -> np.ndarray:
    """Every row of ``weights`` (bytes) times each token of ``x [T, cols]`` through ``numba_vnni.dot_rows``."""
    routine = kernels.ggml_routines().routines[qtype]
    n_tokens, cols = x.shape
    out = np.empty((n_tokens, weights.shape[0]), np.float32)
    nk.use_threads(threads)
    numba_vnni.dot_rows(int(qtype), routine.from_float, weights, np.arange(weights.shape[0]), x,
                        np.zeros((n_tokens, routine.encoded_bytes(cols)), np.uint8),
                        np.zeros((n_tokens, numba_vnni.encoded_bytes(int(qtype), cols)), np.uint8), out)
    return out


def _extreme_rows(qtype: Q, cols: int, rng) -> np.ndarray:
    """Random rows, then rows of the smallest and of the largest stored value with large scales, and a zero row."""
    block_bytes = {Q.Q4_0: 18, Q.Q8_0: 34}[qtype]
    w = quantize(rng.standard_normal((37, cols)).astype(np.float32), qtype)
    blocks = w.reshape(37, -1, block_bytes)
    blocks[0, :, 2:] = 0x00 if qtype is Q.Q4_0 else 0x80  # nibble 0 (-8) / int8 -128
    blocks[1, :, 2:] = 0xFF if qtype is Q.Q4_0 else 0x7F  # nibble 15 (7) / int8 127
    blocks[:2, :, :2] = np.full((2, cols // 32, 1), 3.5, np.float16).view(np.uint8)
    w[2] = 0
    return w


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("cols", [128, 384, 2048])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("n_tokens", [1, 6])  # six: four unpacked together (``row_dots``), then two alone
def test_row_dot_is_the_product_with_x_as_q8_0(qtype, cols, threads, n_tokens):
    """Against float64 NumPy on gguf's own dequantization of the weights and of x's q8_0 encoding: equal
    up to float32 summation order, extreme rows included, each token's own."""
    rng = np.random.default_rng(cols)
    w = _extreme_rows(qtype, cols, rng)
    spikes = np.where(np.arange(cols) % 97 == 0, 40, 1).astype(np.float32)
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32) * spikes
    got = _row_dots(qtype, w, x, threads)
    weights = dequantize(w, qtype).astype(np.float64)
    seen = dequantize(quantize(x, Q.Q8_0), Q.Q8_0).astype(np.float64)
    want = seen @ weights.T
    scale = np.abs(seen) @ np.abs(weights).T
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-30)
    assert not got[:, 2].any()


def test_a_one_token_matvec_takes_it_and_agrees_with_vec_dot(monkeypatch):
    """``kernels.matvec`` (an output head) on one token: ``dot_rows`` here, ggml's ``vec_dot`` without it."""
    rng = np.random.default_rng(5)
    for qtype in (Q.Q4_0, Q.Q8_0):
        m = QuantMatrix(qtype, quantize(rng.standard_normal((300, 256)).astype(np.float32), qtype))
        x = rng.standard_normal((1, 256)).astype(np.float32)
        rows = rng.permutation(300)[:77]
        got = kernels.matvec(m, x, rows)
        with monkeypatch.context() as patch:
            patch.setattr(numba_vnni, "available", lambda: False)
            want = kernels.matvec(m, x, rows)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_only_rows_a_whole_number_of_groups_wide_take_it():
    assert numba_vnni.usable(Q.Q4_0, 128) and numba_vnni.usable(Q.Q4_0, 4096) and numba_vnni.usable(Q.Q8_0, 64)
    assert not numba_vnni.usable(Q.Q4_0, 64) and not numba_vnni.usable(Q.Q8_0, 96)
    assert not numba_vnni.usable(Q.F16, 128)


def _q4_0_model(tmp_path_factory, d_model: int):
    from gguf_fixtures import FAST_TRAINING

    out = tmp_path_factory.mktemp("vnni") / f"wide-{d_model}.powerinfer.gguf"
    shape = Shape(d_model, 384, 2, 4, 2, vocab_size=4096, context=128)
    return synthesize(shape, out, "q4_0", Planting(density=0.1), profile_tokens=1280, train=FAST_TRAINING,
                      progress=False).powerinfer


@pytest.fixture(scope="module")
def wide_tiny(tmp_path_factory):
    """A q4_0 model 128 wide (synth's test-tiny is 64: too narrow for groups of four blocks)."""
    return _q4_0_model(tmp_path_factory, 128)


@pytest.fixture(scope="module")
def ragged_tiny(tmp_path_factory):
    """160 wide: a group of four blocks, then a block that ggml's ``vec_dot`` computes (as SmolLM2's 576)."""
    return _q4_0_model(tmp_path_factory, 160)


@njit
def _takes_vnni(w) -> bool:  # a LayerWeights' field, read in compiled code (the proxy has no attributes)
    return w.vnni


def _steps(model, tokens) -> np.ndarray:
    caches = model.new_cache()
    return np.concatenate([model.forward(tokens[i : i + 1], caches) for i in range(len(tokens))])


@pytest.mark.parametrize("width", ["wide_tiny", "ragged_tiny"])
@pytest.mark.parametrize("mode,ram", [(FFNMode.SPARSE, False), (FFNMode.DENSE, False), (FFNMode.SPARSE, True)])
def test_the_runtime_computes_with_it_what_it_computes_with_vec_dot(width, request, monkeypatch, mode, ram):
    """Decoded tokens (the compiled path, whose gate/up rows take ``row_dot``, and ``vec_dot`` for the
    blocks after its last whole group): the same neurons, logits within float32 summation order; also under
    a RAM budget, where the rows are a neuron cache's."""
    path = request.getfixturevalue(width)
    tokens = np.random.default_rng(2).integers(0, 4096, 10)
    budget = os.path.getsize(path) - 80 * 1024 if ram else None  # about half of the FFN rows resident

    def decoded(vnni: bool):
        monkeypatch.setattr(numba_vnni, "available", lambda: vnni)
        model = load_runtime_model(path, ram=budget)
        model.mode = mode
        decoder = model.compiled_decoder()
        assert decoder is not None and all(_takes_vnni(w) == vnni for w, *_ in decoder.steps[mode])
        return _steps(model, tokens), model.stats

    (steps, stats), (want, want_stats) = decoded(True), decoded(False)
    assert stats == want_stats
    np.testing.assert_allclose(steps, want, rtol=0, atol=1e-5 * np.abs(want).max())


_WITHOUT_VNNI = """
import sys
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from powerinfer_tools import kernels
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.kernels import numba_vnni
from powerinfer_tools.kernels.quant import QuantMatrix
from powerinfer_tools.runtime.loader import load_runtime_model

assert not numba_vnni.available()
rng = np.random.default_rng(0)
for qtype in (Q.Q4_0, Q.Q8_0):  # the plain-IR spelling of vpdpbusd computes the same products
    m = QuantMatrix(qtype, quantize(rng.standard_normal((64, 256)).astype(np.float32), qtype))
    x = rng.standard_normal(256).astype(np.float32)
    routine = kernels.ggml_routines().routines[qtype]
    out = np.empty((1, 64), np.float32)
    numba_vnni.dot_rows(int(qtype), routine.from_float, m.data, np.arange(64), x[None],
                        np.zeros((1, routine.encoded_bytes(256)), np.uint8),
                        np.zeros((1, numba_vnni.encoded_bytes(int(qtype), 256)), np.uint8), out)
    want = kernels.matvec(m, x[None])[0]
    assert np.abs(out[0] - want).max() <= 1e-5 * np.abs(want).max(), qtype
model = load_runtime_model(sys.argv[1])
model.mode = FFNMode.SPARSE
assert model.compiled_decoder() is not None
caches = model.new_cache()
np.save(sys.argv[2], np.concatenate([model.forward(np.array([t]), caches) for t in (5, 77, 1234)]))
"""


# Haswell's features (AVX2, FMA, F16C; no AVX-512): numba takes the host's unless told, whatever the CPU name.
_HASWELL = ("+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+lzcnt,+movbe,+mmx,+pclmul,+popcnt,+sse,+sse2,"
            "+sse3,+sse4.1,+sse4.2,+ssse3,+xsave")


@pytest.mark.slow
def test_the_kernels_compile_and_run_for_a_cpu_without_avx512(wide_tiny, tmp_path, monkeypatch):
    """Compiled for Haswell (AVX2, no AVX-512; numba's own cache kept apart): the functions that hold the
    VNNI kernels still compile (with the intrinsic LLVM aborts there, "Do not know how to split the
    result of this operator": they spell it in plain IR), that spelling computes the same products,
    and the runtime decodes through ggml's kernels as this process does with the VNNI ones off."""
    import subprocess
    import sys

    logits = tmp_path / "logits.npy"
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=_HASWELL,
               NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    run = subprocess.run([sys.executable, "-c", _WITHOUT_VNNI, str(wide_tiny), str(logits)], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    monkeypatch.setattr(numba_vnni, "available", lambda: False)
    model = load_runtime_model(wide_tiny)
    model.mode = FFNMode.SPARSE
    caches = model.new_cache()
    want = np.concatenate([model.forward(np.array([t]), caches) for t in (5, 77, 1234)])
    np.testing.assert_allclose(np.load(logits), want, rtol=0, atol=1e-5 * np.abs(want).max())
