"""The weight types' rows as the one answer to "does kernel X take type Y" (formats/weight_types.py): a row that
claims a kernel its module has no code for fails that module's import, the kernels' predicates read the rows, and a
compiled kernel given a type it has no code for raises instead of decoding it as another type."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from powerinfer_tools import kernels
from powerinfer_tools.formats.weight_types import (WEIGHT_TYPES, Kernel, KernelClaimError, implementations,
                                                   types_with)
from powerinfer_tools.kernels.interleaved import can_interleave
from powerinfer_tools.kernels.quant import ARRAY_DECODERS, QuantMatrix

REPO = Path(__file__).resolve().parent.parent
# Each kernel with code for some types, and the module whose import checks the rows' claims of it
CHECKED_AT_IMPORT = {
    Kernel.ARRAY_DECODE: "powerinfer_tools.kernels.quant",
    Kernel.COMPILED_DECODE: "powerinfer_tools.kernels.numba_dequant",
    Kernel.AXPY: "powerinfer_tools.kernels.numba_kernels",
    Kernel.VNNI_ROW_DOT: "powerinfer_tools.kernels.numba_vnni",
    Kernel.VNNI_GATE_UP: "powerinfer_tools.kernels.numba_vnni",
    Kernel.VNNI_VEC_DOT: "powerinfer_tools.kernels.numba_kquants",
    Kernel.INTERLEAVED: "powerinfer_tools.kernels.interleaved",
    Kernel.BF16_ROW_SUM: "powerinfer_tools.kernels.numba_bf16",
    Kernel.NARROW_ROW_DOT: "powerinfer_tools.kernels.numba_kernels",
}
UNCLAIMED = Q.Q5_0  # no kernel of ours takes it but the bfloat16 matmul: ggml's vec_dot and to_float compute it


def claiming(qtype: Q, kernels_: frozenset) -> dict:
    """The table with ``qtype``'s row claiming ``kernels_`` instead of its own."""
    return {**WEIGHT_TYPES, qtype: dataclasses.replace(WEIGHT_TYPES[qtype], kernels=kernels_)}


def test_every_kernel_but_the_bfloat16_matmul_has_its_claims_checked():
    """The bfloat16 matmul takes rows of every type (ggml's to_float dequantizes them): its claims say where it pays."""
    assert set(Kernel) - set(CHECKED_AT_IMPORT) == {Kernel.BF16_MATMUL}
    assert not WEIGHT_TYPES[UNCLAIMED].kernels & set(CHECKED_AT_IMPORT)


def test_a_dispatch_table_holds_the_claimed_types_and_refuses_a_claim_without_code():
    implemented = {Q.F32: "f32 code", Q.Q4_0: "q4_0 code", Q.Q8_0: "q8_0 code"}
    assert implementations(Kernel.COMPILED_DECODE, implemented, "here") == {Q.Q8_0: "q8_0 code", Q.Q4_0: "q4_0 code"}
    rows = claiming(UNCLAIMED, WEIGHT_TYPES[UNCLAIMED].kernels | {Kernel.COMPILED_DECODE})
    assert types_with(Kernel.COMPILED_DECODE, rows) == (Q.Q8_0, Q.Q4_0, UNCLAIMED)
    with pytest.raises(KernelClaimError, match=r"^formats/weight_types.py: q5_0 claims the compiled decoder, which "
                                               r"here has no implementation for$"):
        implementations(Kernel.COMPILED_DECODE, implemented, "here", rows)


@pytest.mark.parametrize("kernel", CHECKED_AT_IMPORT, ids=lambda k: k.name)
def test_a_row_that_claims_a_kernel_its_module_lacks_fails_at_import(kernel):
    """The row changed in a fresh process, then the module imported: the import raises, naming row and module."""
    module = CHECKED_AT_IMPORT[kernel]
    code = ("import dataclasses\n"
            "from powerinfer_tools.formats import weight_types as w\n"
            f"row = w.WEIGHT_TYPES[w.{UNCLAIMED.name}]\n"
            f"claims = row.kernels | {{w.Kernel.{kernel.name}}}\n"
            f"w.WEIGHT_TYPES[w.{UNCLAIMED.name}] = dataclasses.replace(row, kernels=claims)\n"
            f"import {module}\n")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert (f"KernelClaimError: formats/weight_types.py: {UNCLAIMED.name.lower()} claims the {kernel.value}, which "
            f"{module} has no implementation for") in done.stderr, done.stderr[-2000:]


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
    x = np.ones((1, 128), np.float32)
    with pytest.raises(ValueError, match=message):
        numba_vnni.dot_rows(int(UNCLAIMED), 0, weights, rows, x, np.zeros((1, 256), np.uint8),
                            np.zeros((1, 4096), np.uint8), np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match=message):
        numba_vnni.encode(int(UNCLAIMED), np.zeros(256, np.uint8), np.zeros(4096, np.uint8), 128)
