"""The weight types' rows as the one answer to "does kernel X take type Y" (formats/weight_types.py): a dispatch table
holds the types that claim its kernel, a claim without code is refused, the kernels' predicates read the rows, and a
compiled kernel given a type it has no code for raises instead of decoding it as another type."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from powerinfer_tools import kernels
from powerinfer_tools.formats.weight_types import (WEIGHT_TYPES, Kernel, KernelClaimError, implementations,
                                                   types_with)
from powerinfer_tools.kernels.interleaved import can_interleave
from powerinfer_tools.kernels.quant import ARRAY_DECODERS, QuantMatrix

UNCLAIMED = Q.Q5_0  # no kernel of ours takes it but the bfloat16 matmul: ggml's vec_dot and to_float compute it


def claiming(qtype: Q, kernels_: frozenset) -> dict:
    """The table with ``qtype``'s row claiming ``kernels_`` instead of its own."""
    return {**WEIGHT_TYPES, qtype: dataclasses.replace(WEIGHT_TYPES[qtype], kernels=kernels_)}


def test_a_dispatch_table_holds_the_claimed_types_and_refuses_a_claim_without_code():
    implemented = {Q.F32: "f32 code", Q.Q4_0: "q4_0 code", Q.Q8_0: "q8_0 code"}
    assert implementations(Kernel.COMPILED_DECODE, implemented, "here") == {Q.Q8_0: "q8_0 code", Q.Q4_0: "q4_0 code"}
    rows = claiming(UNCLAIMED, WEIGHT_TYPES[UNCLAIMED].kernels | {Kernel.COMPILED_DECODE})
    assert types_with(Kernel.COMPILED_DECODE, rows) == (Q.Q8_0, Q.Q4_0, UNCLAIMED)
    with pytest.raises(KernelClaimError, match=r"^formats/weight_types.py: q5_0 claims the compiled decoder, which "
                                               r"here has no implementation for$"):
        implementations(Kernel.COMPILED_DECODE, implemented, "here", rows)


def test_the_predicates_read_the_rows(monkeypatch):
    """q4_0 takes every kernel of ours until its row stops claiming them."""
    from powerinfer_tools.kernels import numba_kernels

    m = QuantMatrix(Q.Q4_0, quantize(np.random.default_rng(0).standard_normal((16, 256)).astype(np.float32), Q.Q4_0))
    assert numba_kernels.axpy_takes(Q.Q4_0, 256) and can_interleave(m) and Q.Q4_0 in ARRAY_DECODERS
    questions = (kernels.vnni_rows, kernels.bf16_row_sums, kernels.bf16_matmuls)
    answers = [ask(m) for ask in questions]  # these also need the CPU's instructions
    monkeypatch.setitem(WEIGHT_TYPES, Q.Q4_0, claiming(Q.Q4_0, frozenset())[Q.Q4_0])
    assert not numba_kernels.axpy_takes(Q.Q4_0, 256) and not can_interleave(m)
    assert not any(ask(m) for ask in questions), answers


@pytest.fixture
def compiled():
    if not kernels.available():
        pytest.skip(f"compiled kernels unavailable: {kernels.unavailable_reason()}")


def test_compiled_kernels_given_a_type_they_have_no_code_for_raise(compiled):
    """The axpy once decoded such rows as f32; now its entry points, and numba_vnni's, raise before any loop."""
    from powerinfer_tools.kernels import numba_kernels, numba_vnni

    t = WEIGHT_TYPES[UNCLAIMED]
    weights = np.zeros((4, t.row_bytes(64)), np.uint8)
    rows, out = np.arange(4), np.zeros((1, 64), np.float32)
    coeffs = np.ones((1, 4), np.float32)
    message = "a weight type this kernel has no code for"
    for axpy in (numba_kernels.axpy_rows, numba_kernels.axpy_rows_one_token):
        with pytest.raises(ValueError, match=message):
            axpy(int(UNCLAIMED), weights, rows, coeffs, out, 1)
    assert not out.any()
    x = np.ones(128, np.float32)
    with pytest.raises(ValueError, match=message):
        numba_vnni.dot_rows(int(UNCLAIMED), 0, weights, rows, x, np.zeros(256, np.uint8), np.zeros(4096, np.uint8),
                            np.zeros(4, np.float32))
    with pytest.raises(ValueError, match=message):
        numba_vnni.encode(int(UNCLAIMED), np.zeros(256, np.uint8), np.zeros(4096, np.uint8), 128)
