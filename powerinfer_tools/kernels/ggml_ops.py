"""ggml's CPU dot-product routines, taken from the libraries that llama-cpp-python installs.

llama-cpp-python ships ``libggml-cpu.so`` in its package's ``lib/`` folder. Its public header
(``ggml-cpu.h``) exports ``ggml_cpu_init`` and ``ggml_get_type_traits_cpu(type)``, which returns

    struct ggml_type_traits_cpu {
        ggml_from_float_t from_float;   // void (const float *x, void *y, int64_t k): encodes x as `type`
        ggml_vec_dot_t    vec_dot;      // void (int n, float *s, size_t bs, const void *x, size_t bx,
                                        //       const void *y, size_t by, int nrc)
        enum ggml_type    vec_dot_type; // the encoding vec_dot wants its second operand in
        int64_t           nrows;
    };

``vec_dot(W row, y)`` wants ``y`` encoded as ``vec_dot_type``, so (as in llama.cpp's mul_mat) x is
encoded with the ``from_float`` of *that* type's traits, not of the weight's. ``vec_dot`` is the
SIMD kernel llama.cpp itself runs (AVX2/AVX-512/NEON, picked when the library was built), which is
why it is worth calling rather than rewriting. Only the addresses are read here; numba code calls
them (see ``numba_kernels``).

Pinned: written against the ggml 0.25.3 vendored by llama-cpp-python 0.3.36. The struct and the
type ids are ggml's ABI, not a promise, so ``load`` checks them before anything uses them: the
block sizes of the type ids (``ggml_base``), the ``vec_dot_type`` of each type against
``formats/weight_types.py``, and one quantize + dot per type compared with the NumPy reference. A
library that fails any check is refused, never used.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q

from powerinfer_tools.formats.weight_types import WEIGHT_TYPES, WeightType
from powerinfer_tools.kernels import ggml_base
from powerinfer_tools.kernels.ggml_base import GgmlUnavailable
from powerinfer_tools.kernels.interleaved import ROWS, interleave
from powerinfer_tools.kernels.quant import QuantMatrix

TESTED_VERSION = "0.3.36"  # llama-cpp-python release whose ggml this module was checked against

_FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_VEC_DOT = ctypes.CFUNCTYPE(
    None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
)


# gemv and gemm over q4_0 interleaved eight rows at a time (``kernels.interleaved``):
# void (int n, float *s, size_t bs, const void *vx, const void *vy, int nr, int nc) computes
# s[t * bs + i] = x_t . W_i for the nr tokens of vy and the nc rows (a multiple of 8) at vx; gemm takes
# nr a multiple of 4, x quantized four rows at a time by ggml_quantize_mat_q8_0_4x8 (x, vy, n), gemv
# one token (nr = 1) as plain q8_0. ggml runs them for q4_0 on x86 CPUs with AVX2; elsewhere it
# picks other layouts, and so the runtime does not interleave there.
_INTERLEAVED = ("ggml_gemv_q4_0_8x8_q8_0", "ggml_gemm_q4_0_8x8_q8_0", "ggml_quantize_mat_q8_0_4x8")
_PRODUCT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                            ctypes.c_void_p, ctypes.c_int, ctypes.c_int)


class _TypeTraitsCpu(ctypes.Structure):
    _fields_ = [
        ("from_float", ctypes.c_void_p),
        ("vec_dot", ctypes.c_void_p),
        ("vec_dot_type", ctypes.c_int),
        ("nrows", ctypes.c_int64),
    ]


@dataclass(frozen=True)
class DotRoutine:
    """The two function addresses that compute ``dot(W row, x)`` for one weight type."""

    from_float: int  # encodes float32 x as the weight type's vec_dot_type
    vec_dot: int
    weight_type: WeightType

    def encoded_bytes(self, cols: int) -> int:
        """Bytes of one ``cols``-long vector encoded as ``vec_dot_type``."""
        return self.weight_type.encoded_bytes(cols)

    def dot(self, row: np.ndarray, x: np.ndarray) -> float:
        """One product through ctypes: slow, for the load-time check only."""
        encoded = np.empty(self.encoded_bytes(x.size), dtype=np.uint8)
        _FROM_FLOAT(self.from_float)(x.ctypes.data, encoded.ctypes.data, x.size)
        result = ctypes.c_float()
        _VEC_DOT(self.vec_dot)(x.size, ctypes.addressof(result), 0, row.ctypes.data, 0, encoded.ctypes.data, 0, 1)
        return result.value


@dataclass(frozen=True)
class InterleavedRoutines:
    """ggml's products over interleaved q4_0 (``_INTERLEAVED``), by address."""

    gemv: int
    gemm: int
    quantize4: int  # four rows of x as q8_0, interleaved as gemm reads them


@dataclass(frozen=True)
class GgmlCpu:
    """The checked routines, one per supported weight type, and where they came from."""

    routines: dict[Q, DotRoutine]
    library: Path
    version: str
    interleaved: InterleavedRoutines | None  # None where ggml would not use that layout on this CPU
    vec_dots_of_ours: frozenset[Q] = frozenset()  # the types whose vec_dot is not ggml's (``with_vec_dots``)

    def with_vec_dots(self, vec_dots: Mapping[int, int], where: str) -> GgmlCpu:
        """These routines with the ``vec_dot`` of each type in ``vec_dots`` (by ggml type id: the address of a
        function with ggml's interface that takes the same encoding of x) in place of ggml's, each checked as
        ggml's are at load; ``where`` names their module in an error."""
        routines = dict(self.routines)
        for type_id, address in vec_dots.items():
            qtype = Q(type_id)
            routines[qtype] = dataclasses.replace(routines[qtype], vec_dot=address)
            _check_numerics(qtype, routines[qtype], where)
        return dataclasses.replace(self, routines=routines,
                                   vec_dots_of_ours=self.vec_dots_of_ours | {Q(t) for t in vec_dots})


def load() -> GgmlCpu:
    """Load libggml-cpu from the installed llama_cpp package and check its ABI, or raise GgmlUnavailable."""
    base = ggml_base.load()  # checks the type ids' block sizes; libggml-cpu links against it
    cpu_path = base.lib_dir / "libggml-cpu.so"
    origin = f"{cpu_path} (llama-cpp-python {base.version})"
    try:
        # RUNPATH=$ORIGIN makes the loader find libggml-base beside it; the same objects are
        # shared with llama_cpp if that is imported too.
        cpu = ctypes.CDLL(str(cpu_path))
        cpu.ggml_cpu_init.restype = None
        cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_TypeTraitsCpu)
        cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    except (OSError, AttributeError) as exc:  # missing file, or a build without these symbols
        raise GgmlUnavailable(f"cannot load {cpu_path}: {exc}") from exc
    cpu.ggml_cpu_init()  # fills ggml's f16 lookup tables, which the f16 routines read
    routines = {}
    for qtype, weight_type in WEIGHT_TYPES.items():
        traits = cpu.ggml_get_type_traits_cpu(int(qtype)).contents
        encoder = cpu.ggml_get_type_traits_cpu(int(weight_type.vec_dot_type)).contents
        if traits.vec_dot_type != weight_type.vec_dot_type or not encoder.from_float or not traits.vec_dot:
            raise GgmlUnavailable(
                f"{origin}: type traits of {qtype.name} do not have the layout of ggml 0.25.3 "
                f"(vec_dot_type={traits.vec_dot_type}); tested with {TESTED_VERSION}"
            )
        routine = DotRoutine(encoder.from_float, traits.vec_dot, weight_type)
        _check_numerics(qtype, routine, origin)
        routines[qtype] = routine
    return GgmlCpu(routines, cpu_path, base.version, _interleaved_routines(cpu, routines[Q.Q4_0]))


def _interleaved_routines(cpu: ctypes.CDLL, q4_0: DotRoutine) -> InterleavedRoutines | None:
    """The interleaved q4_0 products where ggml itself would run them (x86 with AVX2) and they agree with
    ``vec_dot`` on a small matrix; None otherwise (the runtime then keeps q4_0 rows as stored)."""
    try:
        addresses = [ctypes.cast(getattr(cpu, name), ctypes.c_void_p).value for name in _INTERLEAVED]
        has_avx2 = cpu.ggml_cpu_has_avx2()
    except AttributeError:  # another build, or another architecture's
        return None
    if not has_avx2:
        return None
    routines = InterleavedRoutines(*addresses)
    rng = np.random.default_rng(0)
    rows, cols, tokens = 2 * ROWS, 64, 4
    weights = rng.standard_normal((rows, cols)).astype(np.float32)
    matrix = QuantMatrix(Q.Q4_0, ggml_base.load().quantize(weights, Q.Q4_0))
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    expected = np.array([[q4_0.dot(row, token) for row in matrix.data] for token in x], dtype=np.float32)
    packed = interleave(matrix).data
    one = np.zeros(rows, np.float32)
    encoded = np.empty(q4_0.encoded_bytes(cols), np.uint8)
    _FROM_FLOAT(q4_0.from_float)(x[0].ctypes.data, encoded.ctypes.data, cols)
    _PRODUCT(routines.gemv)(cols, one.ctypes.data, 0, packed.ctypes.data, encoded.ctypes.data, 1, rows)
    four = np.zeros((tokens, rows), np.float32)
    encoded4 = np.empty(tokens * q4_0.encoded_bytes(cols), np.uint8)
    _FROM_FLOAT(routines.quantize4)(x.ctypes.data, encoded4.ctypes.data, cols)
    _PRODUCT(routines.gemm)(cols, four.ctypes.data, rows, packed.ctypes.data, encoded4.ctypes.data, tokens, rows)
    # the same q8_0 x and integer dots as vec_dot: equal up to float32 summation order
    scale = np.abs(expected).max()
    if not (np.allclose(one, expected[0], atol=1e-4 * scale) and np.allclose(four, expected, atol=1e-4 * scale)):
        return None
    return routines


def _check_numerics(qtype: Q, routine: DotRoutine, origin: str) -> None:
    """One dot product against the NumPy reference: a wrong ABI gives garbage, not a small error. The row is one
    of ``ggml_base.check_rows`` (random bytes) whose values are all finite, not a quantizer's output (ggml's for
    iq3_s first builds its grid tables: a cost at every start)."""
    stored = ggml_base.check_rows(qtype)
    with np.errstate(all="ignore"):  # random scales: some rows hold f16's infinities or NaNs
        finite = np.isfinite(WEIGHT_TYPES[qtype].dequantize(stored)).all(axis=1)
    matrix = QuantMatrix(qtype, stored[np.flatnonzero(finite)[:1]])
    x = np.random.default_rng(0).standard_normal(matrix.cols).astype(np.float32)
    expected = float(matrix.matmul(x[None])[0, 0])
    got = routine.dot(matrix.data[0], x)
    scale = float(np.abs(matrix.dequantize_rows() * x).sum())
    if not abs(got - expected) <= 1e-2 * scale:  # the rounding of x (q8_0, q8_1, q8_K) stays far below 1%
        raise GgmlUnavailable(f"{origin}: {qtype.name} vec_dot gave {got}, the NumPy reference {expected}")
