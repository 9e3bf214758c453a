"""The compiled one-token decode path: one token on the CPU, a whole layer per compiled call.

The runtime's one specialization of the layer math that both engines share (``models.layers``): the general path
(``RuntimeModel._layer``) runs a layer as some fifty NumPy operations and kernel calls: for a 22-layer model with
tiny matrices, a fixed cost per token many times this whole path's (docs/lab/benchmarks-history.md, "Per-token
overhead"). For the common case -- one token, every layer on the CPU, a LLaMA-family or Gemma 3 block (RMSNorm, and
Gemma's per head on q/k and after each block; RoPE in either pair order, with each layer's base and window; gated
FFN; no biases but q/k/v's) in dense, predicted or thresholded sparse mode -- ``CompiledDecoder`` runs each layer as
one numba call: the products are loops over weight rows calling ggml's ``vec_dot``, or its ``gemv`` over matrices
the loader interleaved (``kernels.interleaved``: attention, a dense file's FFN, a CATS gate); on a CPU with AVX-512
VNNI, ``numba_vnni``'s products replace both for q4_0 (faster than either from memory: docs/lab/kernels.md, "One
token with AVX-512 VNNI"), fused so that a layer takes five fork/joins of the thread pool: q/k/v, attention, output
projection, gate/up with the activation, and ``numba_kernels.axpy_rows_one_token`` over ``ffn_down_t``; the
predictor's two products, on its stored rows, add one each only when the matrix is large), and the small work
between them (norms, biases, RoPE, the predictor's relu and threshold) is compiled loops. The FFN's part of a layer
(the predictor, gate/up, down and their variants: dense, sparse, thresholded, an expert, behind a neuron cache) is
``ffn_decode``, which runs each layer's FFN plan for the mode (``ffn_plan``), given to it as numbers in the layer's
``LayerWeights`` of that mode; this module runs the layer around it.
A layer outside that case (``layer_refusal``: on a device, other biases, mixed layouts) is left to the
general path for that layer alone (``RuntimeModel.general_layer``); the others still run here.
It computes what the general path computes, up to float32 summation order (and the q8_0 rounding
of inputs that can flip with it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
from gguf import MODEL_TENSOR, GGMLQuantizationType
from numba import njit, prange, types
from numba.experimental import structref

from powerinfer_tools import kernels
from powerinfer_tools.formats.activations import NUMBERS
from powerinfer_tools.formats.constants import PowerInferTensor, block_part
from powerinfer_tools.formats.model_spec import FFNKind, ModelSpec, NormKind
from powerinfer_tools.formats.architecture import RopePairs
from powerinfer_tools.formats.weight_types import WEIGHT_TYPES
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.kernels import numba_interleaved, numba_vnni
from powerinfer_tools.kernels.numba_attention import one_head, score_width
from powerinfer_tools.kernels import numba_kernels as nk
from powerinfer_tools.kernels.interleaved import InterleavedQ4
from powerinfer_tools.kernels import weight_bytes
from powerinfer_tools.kernels.numba_kernels import ggml_from_float, ggml_vec_dot
from powerinfer_tools.kernels.quant import QuantMatrix
from powerinfer_tools.models.layers import KVCache, mix_experts
from powerinfer_tools.runtime import ffn_decode as fd
from powerinfer_tools.runtime.ffn_decode import cached_ffn, choose, expert_ffn, ffn, rows_take_vnni
from powerinfer_tools.runtime.ffn_plan import Cache, Choice, Down, FFNPlan, GateUp
from powerinfer_tools.runtime.neuron_cache import NeuronCache
from powerinfer_tools.runtime.thresholded_ffn import cats_bounds
from powerinfer_tools.kernels.numba_cache import prepare_cache

# The gated FFN kinds it computes, numbered as ``formats/activations.py``
_KINDS = {kind: number for kind, number in NUMBERS.items() if kind.gated}
NO_THRESHOLD = np.float32(-1.0)  # a LayerWeights threshold its rule does not use
# A layer's plan as ``ffn_decode`` numbers it (the oracle's choice runs on the general path only)
_CHOICES = {Choice.EVERY: fd.CHOOSE_EVERY, Choice.TEAL: fd.CHOOSE_EVERY, Choice.PREDICTOR: fd.CHOOSE_PREDICTED,
            Choice.CATS: fd.CHOOSE_BY_GATE, Choice.WHOLE_GATE: fd.CHOOSE_BY_GATE}
_GATE_UPS = {GateUp.ROWS: fd.GATE_UP_ROWS, GateUp.GATE_WHOLE: fd.GATE_WHOLE, GateUp.WHOLE: fd.GATE_UP_WHOLE}
# The attention biases the compiled path adds (Qwen2's); a layer with others takes the general path.
_BIASES = ("q", "k", "v")
_ABSENT = np.zeros(0, np.float32)  # LayerWeights' placeholder for an absent bias or norm (same numba type)
_DOWN, _DOWN_T = block_part(MODEL_TENSOR.FFN_DOWN), block_part(PowerInferTensor.FFN_DOWN_T)  # as messages name them


# Weights and buffers reach the compiled code as numba StructRefs: one pointer each. (A namedtuple of
# arrays costs more per call to type-check than a small layer's work.) The types are module
# level so that numba's on-disk cache recognises them in the next process.


class _Fields(types.StructRef):
    def preprocess_fields(self, fields):
        return tuple((name, types.unliteral(t)) for name, t in fields)


@structref.register
class LayerWeightsType(_Fields):
    pass


@structref.register
class ScratchType(_Fields):
    pass


class LayerWeights(structref.StructRefProxy):
    """One layer's weights; each matrix is raw bytes ([rows, row_bytes] uint8). Matrices that share an
    input share the encoding of it (``attn_types``: the ggml type ids of q, k, v and o, the first three of
    one vec_dot partner type; ``ffn_type`` for gate and up, one type), so the input is encoded once for them
    (``CompiledDecoder.build`` checks). ``attn_gemv``: the address of
    ggml's gemv when q, k, v and o are interleaved q4_0 (``kernels.interleaved``; their bytes are then
    ``[rows / 8, 8 * row_bytes]``), else 0; ``gate_gemv``, ``up_gemv`` and ``down_gemv`` likewise for each of
    the FFN's matrices, which is then always computed whole (a dense file's three; a CATS gate, which it reads
    whole to choose, and the up of a CATS layer that computes most neurons: ``loader.WHOLE_UP_SHARE``);
    ``q_norm, k_norm`` (per head), ``post_attn_norm, post_ffn_norm`` (of each block's output): Gemma 3's
    further RMSNorms, empty when absent; ``attn_scale``: what attention scores are multiplied by, ``attn_softcap``:
    where they are soft-capped (Gemma 2; 0: not capped);
    ``vnni``: this CPU runs ``numba_vnni``'s products (for the interleaved matrices, and the whole groups
    of q4_0 gate/up rows at least a group wide).
    ``kind``: the FFN's, as ``formats/activations.py`` numbers it; ``choice``, ``gate_up``: its plan in one mode
    (``ffn_plan``, as ``ffn_decode`` numbers it; a layer has one ``LayerWeights`` per mode), with the thresholds the
    plan applies (``cats``, ``ffn_in``, ``ffn_down``; ``NO_THRESHOLD`` where it applies none) and the
    predictor's (``threshold``).
    ``cats_bounds``: where CATS's threshold lies on the gate product (``thresholded_ffn.cats_bounds``). ``bq, bk, bv``:
    biases, empty when absent; ``rope_halves``: q and k rotate pairs (i, i + head_dim/2), not (2i, 2i+1)."""


class Scratch(structref.StructRefProxy):
    """Buffers reused by every layer and step."""


structref.define_proxy(LayerWeights, LayerWeightsType, [
    "attn_norm", "wq", "wk", "wv", "wo", "attn_types", "attn_gemv", "bq", "bk", "bv", "rope_halves",
    "ffn_norm", "gate", "up", "ffn_type", "up_gemv", "down", "down_type", "down_transposed", "down_gemv",
    "vnni", "fc1", "fc1_type", "fc2", "fc2_type",
    "threshold", "kind", "choice", "gate_up", "cats", "cats_bounds", "gate_gemv", "ffn_in", "ffn_down",
    "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm", "attn_scale", "attn_softcap",
])
structref.define_proxy(Scratch, ScratchType, [
    "h", "q", "k", "v", "attended", "o", "x_encoded", "scores", "hidden", "active", "gate_out", "up_out", "act",
    "all_rows", "predicted", "down_rows", "x_vnni", "ffn_out",
])


# Made by these cached functions, not by calling the proxies: a proxy's constructor is compiled anew in
# every process (numba does not cache it), for each distinct set of field types: seconds before the
# bundled model's first token.
@njit(cache=True)
def new_layer_weights(*fields):
    return LayerWeights(*fields)


@njit(cache=True)
def new_scratch(*fields):
    return Scratch(*fields)


@njit(nogil=True, cache=True, **nk.FAST_FLOATS)
def _rms_norm(x, weight, eps, out):
    """``out`` = RMSNorm of ``x`` (``out`` may be ``x``)."""
    total = 0.0
    for i in range(x.shape[0]):
        total += x[i] * x[i]
    scale = np.float32(1.0 / math.sqrt(total / x.shape[0] + eps))
    for i in range(x.shape[0]):
        out[i] = x[i] * scale * weight[i]


@njit(nogil=True, cache=True)
def _head_norms(x, head_dim, weight, eps):
    """RMSNorm of each head of ``x`` in place (Gemma 3's q/k norms); an empty ``weight`` (none) does nothing."""
    if weight.shape[0]:
        for base in range(0, x.shape[0], head_dim):
            head = x[base : base + head_dim]
            _rms_norm(head, weight, eps, head)


# --- products: each parallel loop is one fork/join of the thread pool, which costs more than a small
# matrix's work when the other core is busy, so the loops are fused where their inputs allow.


@njit(parallel=True, nogil=True, cache=True)
def _qkv(types, fns, wq, wk, wv, x_encoded, cols, q, k, v):
    """``q, k, v = Wq·x, Wk·x, Wv·x`` in one parallel loop over the rows of all three, each by the ``vec_dot``
    of its own weight type (``types[0..2]``: a Q4_K_M file stores some layers' v as q6_K); x is encoded
    once, as the vec_dot partner type they share."""
    n_q, n_kv, xe = wq.shape[0], wk.shape[0], x_encoded.ctypes.data
    for i in prange(n_q + 2 * n_kv):
        if i < n_q:
            ggml_vec_dot(fns[types[0], 1], cols, q.ctypes.data + 4 * i, wq.ctypes.data + i * wq.strides[0], xe)
        elif i < n_q + n_kv:
            j = i - n_q
            ggml_vec_dot(fns[types[1], 1], cols, k.ctypes.data + 4 * j, wk.ctypes.data + j * wk.strides[0], xe)
        else:
            j = i - n_q - n_kv
            ggml_vec_dot(fns[types[2], 1], cols, v.ctypes.data + 4 * j, wv.ctypes.data + j * wv.strides[0], xe)


# --- the small work between the products


@njit(nogil=True, cache=True)
def _rope(x, n_heads, head_dim, cos, sin, halves):
    """Rotate pairs (2i, 2i+1) of every head, as ggml's normal rope mode (``apply_rope_adjacent``), or with
    ``halves`` (i, i + head_dim/2), as its neox mode and Hugging Face (``apply_rope``)."""
    half = head_dim // 2
    for h in range(n_heads):
        base = h * head_dim
        for i in range(half):
            a, b = (base + i, base + half + i) if halves else (base + 2 * i, base + 2 * i + 1)
            first, second = x[a], x[b]
            x[a] = first * cos[i] - second * sin[i]
            x[b] = first * sin[i] + second * cos[i]


@njit(nogil=True, cache=True)
def _add_bias(x, bias):
    """``x += bias``; an empty ``bias`` (none) adds nothing."""
    for i in range(bias.shape[0]):
        x[i] += bias[i]


@njit(parallel=True, nogil=True, cache=True, **nk.FAST_FLOATS)
def _attend(q, keys, values, first, last, n_heads, scale, softcap, scores, out):
    """Causal attention of one query at position ``last`` over cached positions ``first .. last``, its scores
    multiplied by ``scale`` and soft-capped where ``softcap`` > 0 (``numba_attention.one_head``, a head each)."""
    head_dim = keys.shape[2]
    group = n_heads // keys.shape[1]
    for h in prange(n_heads):
        one_head(q[h * head_dim : (h + 1) * head_dim], keys, values, h // group, first, last + 1, scale, softcap,
                 scores[h], out[h * head_dim : (h + 1) * head_dim])


@njit(nogil=True, cache=True)
def decode_attention(x, w, s, keys, values, pos, first, cos, sin, n_heads, eps, fns, n_threads):
    """A layer's attention for one token at position ``pos`` (updates the residual ``x`` in place, writes
    this token's key and value into ``keys[pos]`` / ``values[pos]``), then its FFN's normed input in ``s.h``."""
    n_kv_heads, head_dim, d_model = keys.shape[1], keys.shape[2], x.shape[0]
    _rms_norm(x, w.attn_norm, eps, s.h)
    ggml_from_float(fns[w.attn_types[0], 0], s.h.ctypes.data, s.x_encoded.ctypes.data, d_model)
    if w.attn_gemv:
        numba_interleaved.gemv_fused(w.attn_gemv, w.wq, w.wk, w.wv, s.x_encoded, d_model, s.q, s.k, s.v, n_threads,
                                     w.vnni)
    else:
        _qkv(w.attn_types, fns, w.wq, w.wk, w.wv, s.x_encoded, d_model, s.q, s.k, s.v)
    _add_bias(s.q, w.bq)
    _add_bias(s.k, w.bk)
    _add_bias(s.v, w.bv)
    _head_norms(s.q, head_dim, w.q_norm, eps)
    _head_norms(s.k, head_dim, w.k_norm, eps)
    _rope(s.q, n_heads, head_dim, cos, sin, w.rope_halves)
    _rope(s.k, n_kv_heads, head_dim, cos, sin, w.rope_halves)
    keys[pos] = s.k.reshape((n_kv_heads, head_dim))
    values[pos] = s.v.reshape((n_kv_heads, head_dim))
    _attend(s.q, keys, values, first, pos, n_heads, w.attn_scale, w.attn_softcap, s.scores, s.attended)
    ggml_from_float(fns[w.attn_types[3], 0], s.attended.ctypes.data, s.x_encoded.ctypes.data, s.attended.shape[0])
    if w.attn_gemv:
        numba_interleaved.gemv(w.attn_gemv, w.wo, s.x_encoded, s.attended.shape[0], s.o, n_threads, w.vnni)
    else:
        nk.matvec(fns[w.attn_types[3], 1], w.wo, s.x_encoded, s.attended.shape[0], s.o)
    if w.post_attn_norm.shape[0]:
        _rms_norm(s.o, w.post_attn_norm, eps, s.o)
    x += s.o

    _rms_norm(x, w.ffn_norm, eps, s.h)


@njit(nogil=True, cache=True)
def decode_chosen(x, w, s, keys, values, pos, first, cos, sin, n_heads, eps, fns, n_threads):
    """``decode_attention``, then the neurons the layer's FFN computes (``ffn_decode.choose``); returns their
    count."""
    decode_attention(x, w, s, keys, values, pos, first, cos, sin, n_heads, eps, fns, n_threads)
    return choose(x, w, s, fns, n_threads)


@njit(nogil=True, cache=True)
def decode_layer(x, w, s, keys, values, pos, first, cos, sin, n_heads, eps, fns, n_threads):
    """One layer for one token at position ``pos`` in one call (``decode_chosen``, then the FFN on the
    rows of the neurons it chose); returns the number of neurons computed and of down rows read."""
    n = decode_chosen(x, w, s, keys, values, pos, first, cos, sin, n_heads, eps, fns, n_threads)
    if not w.post_ffn_norm.shape[0]:
        return ffn(x, w, s, n, fns, n_threads)
    out = s.ffn_out  # Gemma 3: the FFN's output normed before it joins the residual stream
    out[:] = 0.0
    computed = ffn(out, w, s, n, fns, n_threads)
    _rms_norm(out, w.post_ffn_norm, eps, out)
    x += out
    return computed


@dataclass
class CompiledDecoder:
    """The compiled one-token decode path for a model whose every layer runs on the CPU; see the module doc."""

    spec: ModelSpec
    general: list[str | None]  # per layer: why the general path computes it (``layer_refusal``), or None
    general_layer: Callable  # ``RuntimeModel.general_layer``: how it does
    # Per FFN mode it runs, per layer: (its weights, its FFN's plan, its neuron cache under a RAM budget, its
    # mixture of experts), all of that mode; None for a layer left to the general path (``general`` says why).
    steps: dict[FFNMode, list[tuple[LayerWeights, FFNPlan, NeuronCache | None, Mixture | None] | None]]
    mode_refusals: dict[FFNMode, str | None]  # per mode it knows: why its steps take the general path, or None
    scratch: Scratch
    fns: np.ndarray  # int64 [max type id + 1, 2]: from_float and vec_dot addresses by weight type
    # Per layer: float64 [head_dim / 2], the angle per position of each rotated pair, and what cos and sin are
    # multiplied by (``formats/rope.py``; one pair per (theta, scaling), shared by the layers that rotate alike:
    # Gemma 3's global and sliding layers differ).
    rope_frequencies: list[tuple[np.ndarray, float]]
    windows: list[int | None]  # per layer: how many keys its query sees at most (``ModelSpec.layer_window``)
    max_context: int  # positions the scratch holds attention scores for
    active: np.ndarray  # the scratch's ``active``: the neurons a layer's predictor chose
    ffn_input: np.ndarray  # the scratch's ``h``: the normed input of a layer's FFN (the router's too)

    @classmethod
    def build(cls, model) -> CompiledDecoder | None:
        """The decoder for ``model`` (a ``RuntimeModel``), or None when the model needs the general path
        (``refusal`` says why)."""
        if refusal(model) is not None:
            return None
        s = model.spec
        general = [layer_refusal(layer) for layer in model.layers]
        compiled = [layer for layer, reason in zip(model.layers, general) if reason is None]
        ggml = kernels.ggml_routines()
        matrices = [m for layer in compiled for unit in _units(layer) for m in _unit_matrices(layer, *unit)]
        fns = np.zeros((max(int(m.qtype) for m in matrices) + 1, 2), dtype=np.int64)
        for m in matrices:
            fns[int(m.qtype)] = ggml.routines[m.qtype].from_float, ggml.routines[m.qtype].vec_dot
        encoded = max(ggml.routines[m.qtype].encoded_bytes(m.cols) for m in matrices)
        max_context = model.context_size
        hidden = max((predictor.fc1.rows for layer in compiled for _, predictor in _units(layer) if predictor),
                     default=1)
        q_width, kv_width = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
        f32 = lambda n: np.zeros(n, dtype=np.float32)  # noqa: E731
        active = np.zeros(s.d_ff, np.intp)
        h = f32(s.d_model)
        scratch = new_scratch(
            h, f32(q_width), f32(kv_width), f32(kv_width),  # h q k v
            f32(q_width), f32(s.d_model), np.zeros((1, encoded), np.uint8),  # attended o x_encoded
            np.zeros((s.n_heads, score_width(max_context)), np.float32), f32(hidden),  # scores (attention) hidden
            active, f32(s.d_ff), f32(s.d_ff), f32(s.d_ff),  # active gate_out up_out act
            np.arange(s.d_ff, dtype=np.intp), f32(s.d_ff),  # all_rows predicted
            np.zeros(s.d_ff, np.intp),  # down_rows
            np.zeros(numba_vnni.encoded_bytes(nk.Q4_0, s.d_model), np.uint8), f32(s.d_model),  # x_vnni ffn_out
        )
        rope_frequencies = {(theta, scaling): scaling.frequencies(theta, s.head_dim, model.context_size)
                            for theta, scaling in map(s.layer_rope, range(s.n_layers))}
        halves = s.architecture.rope_pairs is RopePairs.HALVES
        refusals = {mode: _mode_refusal(model, mode, general) for mode in (FFNMode.DENSE, FFNMode.SPARSE)}
        steps = {mode: _steps(model, model.ffn_plans[mode], general, halves)
                 for mode, reason in refusals.items() if reason is None}
        return cls(s, general, model.general_layer, steps, refusals,
                   scratch, fns, [rope_frequencies[s.layer_rope(i)] for i in range(s.n_layers)],
                   [s.layer_window(i) for i in range(s.n_layers)], max_context, active, h)

    def usable(self, mode: FFNMode, n_tokens: int, caches: list[KVCache]) -> bool:
        """Whether this step can run here (otherwise the general path runs it, or reports why it cannot)."""
        return self.step_refusal(mode, n_tokens, caches[0].length) is None

    def step_refusal(self, mode: FFNMode, n_tokens: int, filled: int) -> str | None:
        """Why a step of ``n_tokens`` after ``filled`` cached positions takes the general path, or None when it
        runs here. Asked at every step: a step that runs here builds no string."""
        if n_tokens != 1:
            return f"a block of {n_tokens} tokens (a prompt)"
        if filled >= self.max_context:
            return f"context full ({self.max_context} positions)"
        if mode in self.mode_refusals:
            return self.mode_refusals[mode]
        return f"{mode.value} mode, not dense or sparse"

    def forward(self, x: np.ndarray, caches: list[KVCache], mode: FFNMode, step) -> np.ndarray:
        """The residual ``[1, d_model]`` after every layer, from the embedded token ``x``, each layer as its plan
        for ``mode`` says; counts into ``step``."""
        s = self.spec
        pos = caches[0].length
        threads = nk.use_threads(kernels.get_threads())
        residual = np.array(x[0], dtype=np.float32)  # a private copy: updated in place below
        zeros = np.zeros((1, s.n_kv_heads, s.head_dim), dtype=np.float32)
        neurons_total = s.d_ff * max(s.n_experts_used, 1)  # of a layer's FFN (of its routed experts)
        for i, (layer, cache, (cos, sin, first)) in enumerate(zip(self.steps[mode], caches, self._at(pos))):
            if layer is None:  # counts into ``step`` itself
                residual[:] = self.general_layer(i, residual[None], cache, step)[0]
                continue
            w, plan, neurons, mixture = layer
            keys, values = cache.store(0, zeros, zeros)  # reserves position pos; decode_layer fills it in
            cache.advance(1)
            if mixture is not None:  # counts what its experts read
                decode_attention(residual, w, self.scratch, keys, values, pos, first, cos, sin, s.n_heads,
                                 s.norm_eps, self.fns, threads)
                n = mixture.decode(residual, self.ffn_input, self.scratch, s.n_experts_used, self.fns, threads, step)
            elif neurons is None:
                n, m = decode_layer(residual, w, self.scratch, keys, values, pos, first, cos, sin, s.n_heads,
                                    s.norm_eps, self.fns, threads)
                step.bytes_read += plan.bytes_read(n, m)
            else:
                n = decode_chosen(residual, w, self.scratch, keys, values, pos, first, cos, sin, s.n_heads,
                                  s.norm_eps, self.fns, threads)
                before = neurons.counters.snapshot()
                cached_ffn(residual, w, self.scratch, neurons, self.active[:n].copy(), self.fns, threads)
                step.add_cache_use(neurons.counters.since(before))
                step.bytes_read += plan.bytes_read(n, n)
            step.neurons_total += neurons_total
            step.neurons_active += n
        return residual[None]

    def _at(self, pos: int) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """Per layer: the cos and sin of position ``pos``'s rotations, and the first cached position its query
        sees."""
        tables = {}
        for f, factor in self.rope_frequencies:
            if id(f) not in tables:
                angles = pos * f  # as rope_tables computes them: float64, then float32
                tables[id(f)] = (np.cos(angles) * factor).astype(np.float32), (np.sin(angles) * factor).astype(np.float32)
        return [(*tables[id(f)], 0 if window is None else max(0, pos - window + 1))
                for (f, _), window in zip(self.rope_frequencies, self.windows)]


@dataclass
class Mixture:
    """A layer's mixture of experts on the compiled path: its router and each expert's weights (whose
    attention fields are the layer's; ``decode_attention`` runs once, with the first's)."""

    router: np.ndarray  # [n_experts, d_model] float32
    experts: list[LayerWeights]
    plan: FFNPlan  # the layer's, in the experts' mode: what each routed expert reads

    def decode(self, x: np.ndarray, h: np.ndarray, s: Scratch, k: int, fns, n_threads: int, step) -> int:
        """The routed experts' FFNs for one token whose normed FFN input is ``h`` (the scratch's), mixed
        (``models.layers.mix_experts``, on the float32 router) and added to ``x``; returns the neurons
        computed and counts what they read into ``step``."""
        residual = x.copy()  # what the predictors read: the stream entering the FFN block
        computed = []

        def expert_output(e: int, tokens: np.ndarray) -> np.ndarray:
            out = np.zeros((1, x.shape[0]), np.float32)
            computed.append(expert_ffn(out[0], residual, self.experts[e], s, fns, n_threads))
            step.bytes_read += self.plan.bytes_read(computed[-1], computed[-1], e)
            return out

        x += mix_experts((self.router @ h)[None], k, len(self.experts), expert_output, residual[None])[0]
        return sum(computed)


def _units(layer) -> list[tuple]:
    """A layer's FFNs as (partition, predictor): its own, or each expert's."""
    if layer.experts:
        return [(expert.partitions[0], expert.predictor) for expert in layer.experts]
    return [(layer.partitions[0], layer.dense.predictor)]


def refusal(model) -> str | None:
    """Why the compiled decoder cannot take ``model`` (a ``RuntimeModel``): the first condition it fails, in a
    few words (a layer's named by its index), or None when it can."""
    s = model.spec
    if s.norm is not NormKind.RMS:
        return f"{s.norm.value} norm, not RMSNorm"
    if not s.pre_norm:
        return "norms after attention and FFN, not before"
    if s.rope_theta is None:
        return "no rotary position embedding"
    if model.positions is not None:
        return "learned position embeddings"
    if s.ffn not in _KINDS:
        return f"{s.ffn.value} FFN, not {'/'.join(k.value for k in _KINDS)}"
    if not kernels.available():
        return f"compiled kernels unavailable: {kernels.unavailable_reason()}"
    # A layer it refuses is left to the general path (``CompiledDecoder.general``); all of them, the whole token.
    reasons = [layer_refusal(layer) for layer in model.layers]
    return f"no layer it computes (layer 0: {reasons[0]})" if all(reasons) else None


def layer_refusal(layer) -> str | None:
    """Why the compiled path leaves this layer to the general path, or None when it computes it: it needs the layer all on the
    CPU, no biases but q/k/v's, gated FFNs (one CPU partition each; an expert's not through a neuron cache)
    whose ``ffn_down_t`` the axpy loops decode (``nk.axpy_takes``; other types' products all go through
    ggml's ``vec_dot``), one layout for q/k/v/o with one vec_dot partner type for q/k/v (their input is
    encoded once: q4_K with q6_K, as a Q4_K_M file mixes them, share q8_K), and one type for every
    gate/up."""
    d = layer.dense
    if extra := sorted(set(d.biases) - set(_BIASES)):
        return f"{'/'.join(extra)} bias (the compiled decoder adds q/k/v's only)"
    if d.backend.is_device:
        return f"attention on {d.backend.name}"
    if any(len(p) != 1 for p in ([e.partitions for e in layer.experts] or [layer.partitions])):
        return "FFN neurons split between devices"
    partitions = [p for p, _ in _units(layer)]
    if layer.experts and any(p.cache is not None for p in partitions):
        return "experts behind neuron caches (--ram)"
    if d.post_ffn_norm is not None and (layer.experts or partitions[0].cache is not None):
        return "a post-FFN norm on a mixture or behind a neuron cache (--ram)"
    for p in partitions:
        if p.backend.is_device:
            return f"FFN on {p.backend.name}"
        if p.gate is None:
            return "FFN without a gate"
        if p.gate_bias is not None or p.up_bias is not None:
            return "gate/up biases"
        if p.down_t is not None and not nk.axpy_takes(p.down_t.qtype, p.down_t.cols):
            return f"{_DOWN_T} in {_type_name(p.down_t)}, which its axpy does not decode"
        if p.down_t is None and p.down.cols != p.up.rows:
            return f"a dense {_DOWN} over part of the neurons"
    if len({type(m) for m in (d.wq, d.wk, d.wv, d.wo)}) != 1:  # one layout (interleaved: all q4_0)
        return "q/k/v/o in different layouts"
    if len({WEIGHT_TYPES[m.qtype].vec_dot_type for m in (d.wq, d.wk, d.wv)}) != 1:  # x encoded once
        return f"q/k/v in types with different vec_dot inputs ({_type_names((d.wq, d.wk, d.wv))})"
    if len({m.qtype for p in partitions for m in (p.gate, p.up)}) != 1:
        return f"gate/up in different types ({_type_names([m for p in partitions for m in (p.gate, p.up)])})"
    return None


def _mode_refusal(model, mode: FFNMode, general: list[str | None]) -> str | None:
    """Why a step of ``mode`` cannot run here, or None: a plan it has no loop for (every neuron streamed through a
    neuron cache), or a layer without its means of choosing."""
    if mode is FFNMode.SPARSE and not model.can_run_sparse:
        return "sparse mode without a predictor or thresholds for every FFN"
    if any(plan.cache is Cache.STREAMED for plan, reason in zip(model.ffn_plans[mode], general) if reason is None):
        return "dense mode under a RAM budget"  # (the general path streams the neuron caches)
    return None


def _steps(model, plans: list[FFNPlan], general: list[str | None], halves: bool) -> list[tuple | None]:
    """``CompiledDecoder.steps`` of one mode, whose plans are ``plans``."""
    s, steps = model.spec, []
    for layer, plan, reason in zip(model.layers, plans, general):
        if reason is not None:
            steps.append(None)
            continue
        weights = [_unit_weights(layer.dense, *unit, plan, halves, s.attention_scale, s.attn_logit_softcapping, s.ffn)
                   for unit in _units(layer)]
        steps.append((weights[0], plan, None if layer.experts else layer.partitions[0].cache,
                      Mixture(layer.router, weights, plan) if layer.experts else None))
    return steps


def _unit_matrices(layer, partition, predictor) -> list[QuantMatrix]:
    d, p = layer.dense, partition
    weights = [d.wq, d.wk, d.wv, d.wo, p.gate, p.up, p.down_t if p.down_t is not None else p.down]
    return weights + ([] if predictor is None else [predictor.fc1, predictor.fc2])


def _unit_weights(d, p, predictor, plan: FFNPlan, rope_halves: bool, attn_scale: float, attn_softcap: float | None,
                  kind: FFNKind) -> LayerWeights:
    """The compiled weights of one FFN (a layer's, or an expert's, of ``kind``; run as ``plan`` says) with its
    layer's attention ``d``, whose scores are multiplied by ``attn_scale`` and soft-capped at ``attn_softcap``."""
    bq, bk, bv = (d.biases.get(key, _ABSENT) for key in _BIASES)
    down = p.down_t if p.down_t is not None else p.down
    # Without a predictor (dense mode, or thresholds) the fields hold a placeholder of the same numba type.
    fc1, fc2 = ([predictor.fc1, predictor.fc2] if predictor is not None
                else [QuantMatrix(GGMLQuantizationType.F32, np.zeros((1, 1), np.float32))] * 2)
    t = plan.thresholds
    cats, ffn_in, ffn_down = (NO_THRESHOLD if v is None else np.float32(v)
                              for v in ((t.cats, t.ffn_in, t.ffn_down) if t is not None else (None,) * 3))
    interleaved = kernels.ggml_routines().interleaved
    gemv = interleaved.gemv if interleaved else 0  # used by the matrices the loader interleaved
    return new_layer_weights(
        d.attn_norm.weight, weight_bytes(d.wq), weight_bytes(d.wk), weight_bytes(d.wv), weight_bytes(d.wo),
        np.array([d.wq.qtype, d.wk.qtype, d.wv.qtype, d.wo.qtype], np.int64),
        gemv if isinstance(d.wq, InterleavedQ4) else 0, bq, bk, bv, rope_halves,
        d.ffn_norm.weight, weight_bytes(p.gate), weight_bytes(p.up), int(p.gate.qtype),
        gemv if isinstance(p.up, InterleavedQ4) else 0,
        weight_bytes(down), int(down.qtype), p.down_t is not None, gemv if isinstance(down, InterleavedQ4) else 0,
        numba_vnni.available(),
        weight_bytes(fc1), int(fc1.qtype), weight_bytes(fc2), int(fc2.qtype),
        np.float32(predictor.threshold if predictor is not None else 0.0), _KINDS[kind], _CHOICES[plan.choice],
        _GATE_UPS[plan.gate_up], cats,
        cats_bounds(cats, kind) if cats >= 0 and not kind.relu_gated else np.zeros(4),  # (relu's needs none)
        gemv if isinstance(p.gate, InterleavedQ4) else 0,
        ffn_in, ffn_down,
        *(_ABSENT if norm is None else norm.weight for norm in (d.q_norm, d.k_norm, d.post_attn_norm, d.post_ffn_norm)),
        np.float32(attn_scale), np.float32(attn_softcap or 0),
    )


# --- what this path runs, for the execution report (``RuntimeModel.execution_report``): read from the facts
# ``_unit_weights`` and ``decode_layer`` choose by


def attention_kernel(d) -> str:
    """How one token's q/k/v/o products of the attention ``d`` (a ``DenseBlock``) run here."""
    if isinstance(d.wq, InterleavedQ4):  # attn_gemv (one layout for the four: layer_refusal)
        return _interleaved_kernel()
    return _rows((d.wq, d.wk, d.wv, d.wo))


def ffn_kernels(layer, plan: FFNPlan) -> tuple[str, str]:
    """How one token's gate/up and down products of ``layer``'s FFN run here, as its ``plan`` computes them (a
    mixture's experts share their gate/up type: ``layer_refusal``)."""
    p = _units(layer)[0][0]
    whole = _interleaved_kernel()
    vnni = rows_take_vnni.py_func(numba_vnni.available(), int(p.gate.qtype), p.up.cols)
    rows = f"{_type_name(p.up)} rows, AVX-512 VNNI" if vnni else _rows((p.up,))
    if plan.gate_up is GateUp.WHOLE:  # up_gemv beside the gate's (both interleaved: loader._partition)
        gate_up = whole
    elif plan.gate_up is GateUp.GATE_WHOLE:  # ``whole_products``: gemv where interleaved, else every row
        gate = whole if isinstance(p.gate, InterleavedQ4) else _rows((p.gate,))
        gate_up = f"gate whole ({gate}), up {rows}"
    else:
        gate_up = rows
    if plan.down is Down.ROWS:
        down = f"{_DOWN_T} {_type_name(p.down_t)}, axpy of ours"
    else:
        down = whole if isinstance(p.down, InterleavedQ4) else f"{_DOWN} {_rows((p.down,))}"
    return gate_up, down


def _interleaved_kernel() -> str:
    """Interleaved q4_0 matrices' products here: ``numba_interleaved.gemv`` with ``vnni`` as ``_unit_weights``
    sets it."""
    return f"q4_0 interleaved, {'AVX-512 VNNI' if numba_vnni.available() else 'ggml gemv'}"


def _type_name(m: QuantMatrix | InterleavedQ4) -> str:
    return WEIGHT_TYPES[m.qtype].name


def _type_names(matrices) -> str:
    """The matrices' distinct types, in order: ``q4_k/q6_k``."""
    return "/".join(dict.fromkeys(_type_name(m) for m in matrices))


def _rows(matrices) -> str:
    """The matrices' types, in order, each with whose ``vec_dot`` takes its rows (``kernels.vec_dot_name``):
    ``q4_k rows, AVX-512 VNNI vec_dot + q6_k rows, ggml vec_dot``; types that share one, together: ``q4_0/q8_0 rows,
    ggml vec_dot``."""
    by_kernel = {}
    for m in matrices:
        by_kernel.setdefault(kernels.vec_dot_name(m.qtype), {})[_type_name(m)] = None  # (a dict: ordered, once)
    return " + ".join(f"{'/'.join(names)} rows, {kernel}" for kernel, names in by_kernel.items())


prepare_cache(globals())  # stale machine code flushed, the rest loaded without the compiler (kernels.numba_cache)
