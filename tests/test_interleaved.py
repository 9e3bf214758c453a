"""q4_0 matrices interleaved eight rows at a time (kernels/interleaved.py): the layout against ggml's
definition written out element by element, ggml's gemv/gemm for it against vec_dot row by row, and the
runtime, which stores attention and the head that way, against the same model stored as the file has it."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from powerinfer_tools import kernels
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.kernels import ggml_ops
from powerinfer_tools.kernels.interleaved import InterleavedQ4, interleave
from powerinfer_tools.kernels.quant import QuantMatrix
from powerinfer_tools.runtime import engine, loader
from powerinfer_tools.runtime.engine import TokenStats
from powerinfer_tools.runtime.loader import load_runtime_model

ROUTINES = kernels.ggml_routines()
pytestmark = pytest.mark.skipif(ROUTINES is None or ROUTINES.interleaved is None,
                                reason="ggml's interleaved q4_0 kernels do not run on this CPU")


def q4_0(rows: int, cols: int, seed: int = 0) -> QuantMatrix:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return QuantMatrix(Q.Q4_0, quantize(w, Q.Q4_0))


def test_the_layout_is_ggmls_block_q4_0x8():
    """ggml-cpu/repack.cpp: per group of 8 rows and 32-column block, 8 f16 scales, then 16 pieces of 8
    bytes, piece i being bytes 8 * (i // 8) .. of row i % 8's quants, each byte XOR 0x88."""
    m = q4_0(16, 64)
    packed = interleave(m).data
    blocks = m.data.reshape(16, 2, 18)
    for group in range(2):
        for block in range(2):
            want = bytearray()
            for row in range(8):
                want += bytes(blocks[8 * group + row, block, :2])
            for piece in range(16):
                row, start = piece % 8, 2 + 8 * (piece // 8)
                want += bytes(b ^ 0x88 for b in blocks[8 * group + row, block, start : start + 8])
            assert bytes(packed[group, block * 144 : (block + 1) * 144]) == bytes(want)
    assert np.array_equal(interleave(m).deinterleaved().data, m.data)


@pytest.mark.skipif(not kernels.available(), reason="compiled kernels unavailable")
def test_the_compiled_copy_is_the_layout_byte_for_byte_and_blocks_of_rows_take_it():
    """``for_whole_products`` interleaves with the compiled loop where the kernels run: the same bytes as NumPy's
    ``interleave``; a block of tokens times every row of a q4_0 matrix kept in rows goes through that copy and
    ggml's GEMM (the same floats), a subset of its rows through dequantize + BLAS as before."""
    from powerinfer_tools.runtime.backends import CpuBackend

    m = q4_0(1544, 576)  # 193 groups; rows of 18 blocks
    assert np.array_equal(kernels.for_whole_products(m).data, interleave(m).data)
    x = np.random.default_rng(2).standard_normal((kernels.MAX_TOKENS + 9, 576)).astype(np.float32)
    want = kernels.interleaved_matmul(interleave(m), x)
    assert np.array_equal(CpuBackend().matmul(m, x), want)
    assert np.array_equal(CpuBackend().matmul(m, x, np.arange(m.rows)), want)
    some = np.arange(0, m.rows, 3)
    np.testing.assert_allclose(CpuBackend().matmul(m, x, some), want[:, some], rtol=0, atol=2e-2 * np.abs(want).max())


@pytest.mark.parametrize("tokens", [1, 3, 4, 9, 40])
@pytest.mark.parametrize("threads", [1, 3])
def test_products_equal_vec_dot_row_by_row(tokens, threads, monkeypatch):
    """The same q8_0 encoding of x and integer dots as ``matvec``: equal up to float32 summation order,
    for a token, tokens four at a time plus the rest, and a prompt (which ``matvec`` hands elsewhere)."""
    monkeypatch.setattr(kernels, "_threads", threads)
    m = q4_0(72, 256, seed=tokens)  # 9 groups: the threads' shares are uneven
    x = np.random.default_rng(1).standard_normal((tokens, 256)).astype(np.float32)
    want = np.concatenate([kernels.matvec(m, x[t : t + 1]) for t in range(tokens)])
    got = kernels.interleaved_matmul(interleave(m), x)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
@pytest.mark.parametrize("vnni", [False, True])
def test_the_fused_qkv_product_splits_across_matrices(threads, vnni):
    """``gemv_fused`` shares the three matrices' groups between threads as one run, through ggml's gemv
    or (``vnni``, where the CPU has it) ``numba_vnni.interleaved_group``."""
    from powerinfer_tools.kernels import numba_interleaved, numba_vnni

    if vnni and not numba_vnni.available():
        pytest.skip("this CPU lacks AVX-512 VNNI/VBMI")
    q, k, v = (interleave(q4_0(rows, 128, seed)) for seed, rows in enumerate((40, 16, 8)))
    x = np.random.default_rng(4).standard_normal(128).astype(np.float32)
    routine = ROUTINES.routines[Q.Q4_0]
    encoded = np.empty((1, routine.encoded_bytes(128)), np.uint8)
    outs = [np.zeros(p.rows, np.float32) for p in (q, k, v)]
    ggml_ops._FROM_FLOAT(routine.from_float)(x.ctypes.data, encoded.ctypes.data, 128)
    numba_interleaved.gemv_fused(ROUTINES.interleaved.gemv, q.data, k.data, v.data, encoded, 128, *outs, threads,
                                 vnni)
    for p, out in zip((q, k, v), outs):
        want = kernels.matvec(p.deinterleaved(), x[None])[0]
        np.testing.assert_allclose(out, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_only_whole_groups_of_q4_0_rows_are_interleaved():
    assert isinstance(kernels.for_whole_products(q4_0(16, 64)), InterleavedQ4)
    for m in (q4_0(12, 64), QuantMatrix(Q.Q8_0, quantize(np.ones((16, 64), np.float32), Q.Q8_0))):
        assert kernels.for_whole_products(m) is m


def test_routines_that_disagree_with_vec_dot_are_not_used():
    """The load-time check: with gemv and gemm swapped (gemm computes nothing for one token) the
    interleaved layout is not used, rather than giving wrong products."""
    cpu = ctypes.CDLL(str(ROUTINES.library))
    swapped = type("Swapped", (), {
        "ggml_gemv_q4_0_8x8_q8_0": cpu.ggml_gemm_q4_0_8x8_q8_0, "ggml_gemm_q4_0_8x8_q8_0": cpu.ggml_gemv_q4_0_8x8_q8_0,
        "ggml_quantize_mat_q8_0_4x8": cpu.ggml_quantize_mat_q8_0_4x8, "ggml_cpu_has_avx2": staticmethod(lambda: 1)})
    assert ggml_ops._interleaved_routines(swapped, ROUTINES.routines[Q.Q4_0]) is None
    without_avx2 = type("NoAvx2", (swapped,), {"ggml_cpu_has_avx2": staticmethod(lambda: 0)})
    assert ggml_ops._interleaved_routines(without_avx2, ROUTINES.routines[Q.Q4_0]) is None
    assert ggml_ops._interleaved_routines(cpu, ROUTINES.routines[Q.Q4_0]) == ROUTINES.interleaved


def _decode(model, tokens) -> np.ndarray:
    """Logits of each token fed one at a time (the compiled path), then of a prompt of the same tokens."""
    caches = model.new_cache()
    steps = np.concatenate([model.forward(tokens[i : i + 1], caches) for i in range(len(tokens))])
    return steps, model.forward(tokens, model.new_cache())


@pytest.mark.parametrize("which,mode", [("powerinfer", FFNMode.DENSE), ("powerinfer", FFNMode.SPARSE),
                                        ("dense", FFNMode.DENSE)])
def test_the_runtime_computes_with_interleaved_matrices_what_it_does_without(synthesized_tiny, monkeypatch, which,
                                                                             mode):
    """Attention always; a dense file's FFN too (a PowerInfer file's FFN rows are read one by one)."""
    path = getattr(synthesized_tiny, which)
    tokens = np.random.default_rng(0).integers(0, 500, 12)
    model = load_runtime_model(path, neuron_choice="predictor")  # (a gate that chooses is read whole: interleaved)
    model.mode = mode
    ffn = model.layers[0].partitions[0]
    assert all(isinstance(m, InterleavedQ4) for layer in model.layers
               for m in (layer.dense.wq, layer.dense.wk, layer.dense.wv, layer.dense.wo))
    assert all(isinstance(m, InterleavedQ4) == (which == "dense") for m in (ffn.gate, ffn.up, ffn.down_t or ffn.down))
    assert model.compiled_decoder() is not None  # which multiplies interleaved matrices with ggml's gemv
    monkeypatch.setattr(kernels, "interleaves", lambda m: False)
    stored = load_runtime_model(path, neuron_choice="predictor")
    stored.mode = mode
    assert isinstance(stored.layers[0].dense.wq, QuantMatrix)
    (steps, prompt), (want_steps, want_prompt) = _decode(model, tokens), _decode(stored, tokens)
    assert model.stats == stored.stats  # the same neurons computed and bytes read, counted the same way
    np.testing.assert_allclose(steps, want_steps, rtol=0, atol=1e-4 * np.abs(want_steps).max())
    # a prompt's projections see x as q8_0 here, as float32 through dequantize + BLAS there
    np.testing.assert_allclose(prompt, want_prompt, rtol=0, atol=2e-2 * np.abs(want_prompt).max())
    assert model.static_bytes == stored.static_bytes


@pytest.fixture(scope="module")
def cats_file(tmp_path_factory):
    """A q4_0 SiLU model at 50% CATS (thresholds, no predictors): its gate is always computed whole."""
    from powerinfer_tools.benchmarking.synth import SiluSettings, synthesize_silu

    out = tmp_path_factory.mktemp("cats") / "silu.powerinfer.gguf"
    return synthesize_silu("test-tiny", out, "q4_0", SiluSettings(target_sparsity=0.5), calibration_tokens=256,
                           progress=False).powerinfer


@pytest.mark.parametrize("whole_up", [True, False])
@pytest.mark.parametrize("mode", [FFNMode.DENSE, FFNMode.SPARSE])
def test_a_cats_models_gate_is_interleaved_and_computes_the_same(cats_file, monkeypatch, mode, whole_up):
    """Its gate is computed whole, and so is up where CATS keeps at least ``loader.WHOLE_UP_SHARE`` of the
    neurons (this file: half), else up's rows are read by neuron, as down's are. Sparse, a gate product within float32
    summation order of CATS's threshold can tip a neuron either way: most steps agree closely, all on
    the top token. A step counts what it reads: a matrix computed whole, whole."""
    tokens = np.random.default_rng(1).integers(0, 4096, 16)
    for share in ("WHOLE_UP_SHARE", "WHOLE_UP_SHARE_VNNI_ROWS"):  # this file keeps half, below or above them
        monkeypatch.setattr(loader, share, 0.4 if whole_up else 0.6)
    model = load_runtime_model(cats_file)
    model.mode = mode
    partitions = [layer.partitions[0] for layer in model.layers]
    assert all(isinstance(p.gate, InterleavedQ4) and isinstance(p.up, InterleavedQ4 if whole_up else QuantMatrix)
               for p in partitions)
    assert model.compiled_decoder() is not None
    with monkeypatch.context() as patched:
        patched.setattr(kernels, "interleaves", lambda m: False)
        stored = load_runtime_model(cats_file)
    stored.mode = mode
    (steps, _), (want, _) = _decode(model, tokens), _decode(stored, tokens)
    close = np.abs(steps - want).max(axis=1) < 1e-4 * np.abs(want).max()
    assert close.mean() >= (1.0 if mode is FFNMode.DENSE else 0.75)
    assert np.array_equal(steps.argmax(axis=1), want.argmax(axis=1))

    caches = model.new_cache()
    model.forward(tokens[:4], caches)
    model.stats = TokenStats()
    model.forward(tokens[4:5], caches)
    whole = sum(m.nbytes for p in partitions for m in (p.gate, p.up) if isinstance(m, InterleavedQ4))
    rows = partitions[0].down_t.row_bytes + (0 if whole_up else partitions[0].up.row_bytes)
    assert model.stats.bytes_read == model.static_bytes + whole + model.stats.neurons_active * rows


def test_a_gate_that_chooses_is_interleaved_and_a_prompt_computes_with_it(synthesized_tiny, monkeypatch):
    """The gate's choice reads every gate row (``runtime.gate_choice``), so the loader interleaves the gate. A
    sparse prompt chooses from its products, then each token's own neurons from up and ``ffn_down_t`` alone
    (``kernels.batched``, given the gate products); oracle mode, which has no gate products to give, takes
    the union's products (``batched`` cannot read the interleaved gate's rows)."""
    tokens = np.random.default_rng(1).integers(0, 500, 24)
    own = []
    tokens_own_neurons = engine.tokens_own_neurons

    def spied(kind, p, h, ids, mask, gate_pre=None, columns=slice(None)):
        own.append((gate_pre is not None, tokens_own_neurons(kind, p, h, ids, mask, gate_pre, columns)))
        return own[-1][1]

    monkeypatch.setattr(engine, "tokens_own_neurons", spied)
    model = load_runtime_model(synthesized_tiny.powerinfer, neuron_choice="gate")
    assert all(isinstance(layer.partitions[0].gate, InterleavedQ4) for layer in model.layers)
    model.mode = FFNMode.DENSE
    dense = model.forward(tokens, model.new_cache())
    for mode in (FFNMode.SPARSE, FFNMode.ORACLE):
        model.mode, model.stats = mode, TokenStats()
        np.testing.assert_allclose(model.forward(tokens, model.new_cache()), dense, rtol=0,
                                   atol=2e-2 * np.abs(dense).max())
        assert 0 < model.stats.neurons_active < 0.3 * model.stats.neurons_total
    # the sparse block's calls gave the gate products and were taken; the oracle's neither
    assert {(given, out is not None) for given, out in own} == {(True, True), (False, False)}
