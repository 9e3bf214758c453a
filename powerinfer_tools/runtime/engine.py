"""The runtime model: dense blocks and FFN partitions on their backends, one token block at a time."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import NoReturn, Optional

import numpy as np

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.activation_thresholds import LayerThresholds
from powerinfer_tools.formats.model_check import check_finite
from powerinfer_tools.formats.model_file import open_model_file
from powerinfer_tools.formats.model_spec import ModelSpec
from powerinfer_tools.interfaces import Engine, FFNMode
from powerinfer_tools import kernels
from powerinfer_tools.kernels.interleaved import InterleavedQ4
from powerinfer_tools.kernels.kernel_thread import runs_model_work
from powerinfer_tools.kernels.quant import QuantMatrix
from powerinfer_tools.models.layers import (
    KVCache,
    Norm,
    attention_heads,
    decoder_layer,
    embedding_scale,
    mix_experts,
    normalize,
    output_logits,
    rope_tables,
    stored_rotation,
)
from powerinfer_tools.runtime.backends import CpuBackend, move, single_threaded_blas
from powerinfer_tools.runtime.ffn import FFNPartition, Predictor
from powerinfer_tools.runtime.ffn_plan import Cache, Choice, FFNPlan, plan_ffn
from powerinfer_tools.runtime.neuron_cache import CacheCounters, compute_cached
from powerinfer_tools.runtime.generation import context_window, finite_logits
from powerinfer_tools.runtime.selection_meter import SelectionMeter

_UNBUILT = object()  # RuntimeModel._decoder before its first use


@dataclass(frozen=True)
class _Span:
    """The rows of a forward pass's tokens that continue one sequence: ``rows`` of them, after the ``start``
    positions its ``caches`` (one per layer) hold."""

    rows: slice
    caches: list[KVCache]
    start: int

    @property
    def count(self) -> int:
        """Its tokens."""
        return self.rows.stop - self.rows.start

    @property
    def positions(self) -> np.ndarray:
        """Its tokens' positions in its sequence."""
        return np.arange(self.start, self.start + self.count)


@dataclass
class DenseBlock:
    """A layer's attention and norms, and its neuron predictor: resident where the split puts them."""

    backend: object
    attn_norm: Norm
    wq: QuantMatrix | InterleavedQ4  # interleaved on the CPU where its kernels run (loader: whole_matrix)
    wk: QuantMatrix | InterleavedQ4
    wv: QuantMatrix | InterleavedQ4
    wo: QuantMatrix | InterleavedQ4
    ffn_norm: Norm
    biases: dict = field(default_factory=dict)  # "q", "k", "v", "o", "down" -> bias vector
    # Gemma 3's further norms (``models.base.EXTRA_NORMS``): of q and k per head, after attention and the FFN.
    q_norm: Optional[Norm] = None
    k_norm: Optional[Norm] = None
    post_attn_norm: Optional[Norm] = None
    post_ffn_norm: Optional[Norm] = None
    predictor: Optional[Predictor] = None
    # Instead of the predictor: a SiLU model's calibrated sparsity, or the gate's exact choice (``gate_choice``).
    thresholds: Optional[LayerThresholds] = None


@dataclass
class Expert:
    """One expert of a layer's mixture: its FFN's partitions and, in a sparse file, its predictor."""

    partitions: list[FFNPartition]
    predictor: Optional[Predictor] = None


@dataclass
class RuntimeLayer:
    index: int  # its place in the model (a firing meter counts per layer)
    dense: DenseBlock
    partitions: list[FFNPartition]  # device partition first when there is one; none for a mixture
    d_ff: int  # neurons of the FFN, or of each expert
    router: Optional[np.ndarray] = None  # a mixture of experts: [n_experts, d_model] float32 ...
    experts: list[Expert] = field(default_factory=list)  # ... and its experts


@dataclass
class TokenStats:
    """What one forward pass read and computed, summed over layers."""

    steps: int = 0  # forward calls: the prompt is one, then one per generated token
    tokens: int = 0
    neurons_total: int = 0
    neurons_active: int = 0
    neurons_on_device: int = 0
    bytes_read: int = 0
    # Under a RAM budget (neuron caches): cold neurons found in a cache, read from disk, the bytes read.
    cache_hits: int = 0
    cache_misses: int = 0
    disk_bytes: int = 0

    def add(self, other: "TokenStats") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def density(self) -> float:
        """Mean fraction of FFN neurons computed per token."""
        return self.neurons_active / self.neurons_total if self.neurons_total else float("nan")

    @property
    def device_share(self) -> float:
        """Fraction of the computed FFN neurons that the GPU (or its emulation) computed."""
        return self.neurons_on_device / self.neurons_active if self.neurons_active else 0.0

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_read / self.steps if self.steps else float("nan")

    def add_cache_use(self, used: CacheCounters) -> None:
        self.cache_hits += used.hits
        self.cache_misses += used.misses
        self.disk_bytes += used.disk_bytes

    @property
    def hit_rate(self) -> float:
        """Of the cold neurons computed, the share found in a neuron cache."""
        requests = self.cache_hits + self.cache_misses
        return self.cache_hits / requests if requests else float("nan")


class RuntimeModel(Engine):
    """Runs a model read from a GGUF file, with FFN neurons split across backends."""

    def __init__(
        self,
        spec: ModelSpec,
        layers: list[RuntimeLayer],
        token_embd: QuantMatrix,
        output_norm: Optional[Norm],
        output: QuantMatrix | InterleavedQ4,
        positions: Optional[np.ndarray] = None,
        device=None,
        split_path=None,
        metadata: Optional[dict] = None,
        fingerprint: Optional[str] = None,
        head_backend=None,
        host: Optional[CpuBackend] = None,
        path=None,
        context_size: Optional[int] = None,
    ):
        self.spec = spec
        self.path = path  # the model file
        # Positions a sequence may take (default: all the model was trained for): bounds every buffer
        # that grows with the sequence, the KV cache, the attention scores and the decoder's scratch.
        self.context_size = context_window(spec.max_positions, context_size)
        self.layers = layers
        self.token_embd = token_embd
        self.output_norm = output_norm
        self.output = output
        self.positions = positions
        self.device = device  # the GPU backend holding the hot partitions, if a split is in use
        self.split_path = split_path
        self.metadata = metadata or {}  # the model file's GGUF metadata (tokenizer, hyperparameters)
        self.fingerprint = fingerprint  # the model file's (formats.fingerprint): what a result kept for it is keyed by
        self.host = host or CpuBackend()  # the backend of the CPU layers and partitions (one thread pool)
        self.head_backend = head_backend or self.host  # where the output norm and matrix live
        self.mode = FFNMode.DENSE
        self.stats = TokenStats()
        self.static_bytes = (sum(m.nbytes for m in self._dense_matrices())
                             + sum(layer.router.nbytes for layer in layers if layer.router is not None))
        # How each layer's FFN runs in each mode (``ffn_plan``): decided here, looked up per step.
        self.ffn_plans = {mode: [plan_ffn(layer, mode, spec.n_experts_used) for layer in layers] for mode in FFNMode}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="device-ffn")
        self.compiled_decoding = True  # False: single tokens take the general path too (for comparisons)
        self.checks_logits = True  # False: logits that are not finite are returned, not refused (a warm-up's steps)
        # A measurement off the clock (``pitools bench``'s quality pass): in sparse mode every neuron is also
        # computed, on the general path, to count which firing neurons the predictors missed.
        self.firing_meter: Optional[SelectionMeter] = None
        self._decoder = _UNBUILT
        self.ram = None  # ram_budget.RamState when loaded under a RAM budget

    @property
    def can_run_sparse(self) -> bool:
        """Every FFN has its predictor (each layer's, or each expert's of a mixture), or its thresholds."""
        return all(all(e.predictor is not None for e in layer.experts) if layer.experts
                   else layer.dense.predictor is not None or layer.dense.thresholds is not None
                   for layer in self.layers)

    @property
    def can_meter_firing(self) -> bool:
        """Whether a ``firing_meter`` can count what sparse mode misses: a ReLU family's neurons fire (a SiLU
        model's thresholds have no firing to miss) and every row is in memory to find them (no RAM budget)."""
        return self.ram is None and (self.spec.ffn.sparse or all(layer.dense.thresholds is None
                                                                 for layer in self.layers))

    def _dense_matrices(self) -> list[QuantMatrix | InterleavedQ4]:
        per_layer = [m for layer in self.layers for m in (layer.dense.wq, layer.dense.wk, layer.dense.wv, layer.dense.wo)]
        return per_layer + [self.output]

    def new_cache(self) -> list[KVCache]:
        """One KV cache per layer, on the backend that runs the layer's attention."""
        s = self.spec
        return [KVCache(1, s.n_kv_heads, s.head_dim, np.float32, xp=layer.dense.backend.xp) for layer in self.layers]

    def step_fn(self):
        caches = self.new_cache()
        return lambda tokens: self.forward(tokens, caches, all_logits=False)[-1]

    # -- forward --------------------------------------------------------------

    def _norm(self, norm: Norm, x):
        return normalize(self.spec.norm, norm, x, self.spec.norm_eps)

    @runs_model_work  # whichever thread asks: the kernels keep one team of threads (``kernel_thread``)
    def forward(self, tokens: np.ndarray, caches: list[KVCache], all_logits: bool = True) -> np.ndarray:
        """Logits ``[T, vocab]`` (float32, on the host) for tokens following what ``caches`` hold.

        With ``all_logits=False`` only the last token's, ``[1, vocab]``: generation needs no more,
        and the output projection of a whole prompt costs as much as a layer. Logits that are not finite are
        refused, naming the file's damaged tensor (``_refuse_damaged_file``).
        """
        return self._checked(lambda: self._logits(tokens, caches, all_logits))

    @runs_model_work
    def forward_batch(self, blocks: list[np.ndarray], caches: list[list[KVCache]]) -> np.ndarray:
        """Logits ``[B, vocab]`` of the last token of each of B sequences' blocks, in one forward pass: ``blocks[b]``
        (a running sequence's last token, or a joining one's prompt) follows what ``caches[b]`` hold. Every product
        multiplies all the blocks' rows at once, so each weight is read once for all of them, and each layer's FFN
        computes them as its plan computes a block of tokens (dense: whole; sparse: the union of their neurons, or
        each its own while they choose few: ``tokens_own_neurons``); attention is each sequence's over its own
        cache. One block is ``forward``'s (a token's: the compiled decoder's step)."""
        if len(blocks) == 1:
            return self._checked(lambda: self._logits(np.asarray(blocks[0]), caches[0], all_logits=False))
        ends = np.cumsum([len(block) for block in blocks])
        spans = [_Span(slice(end - len(block), end), cache, cache[0].length)
                 for block, cache, end in zip(blocks, caches, ends)]
        return self._checked(lambda: self._general_logits(np.concatenate(blocks), spans, ends - 1))

    def _checked(self, compute) -> np.ndarray:
        """``compute()``'s logits, refused when they are not finite."""
        # A NaN or an infinity on the way shows in the logits, whichever path computed them: NumPy's warnings of
        # it (the compiled decoder gives none) would only be lines before the error.
        with np.errstate(all="ignore"):
            logits = compute()
        if self.checks_logits and not finite_logits(logits):
            self._refuse_damaged_file()
        return logits

    def _logits(self, tokens: np.ndarray, caches: list[KVCache], all_logits: bool) -> np.ndarray:
        span = _Span(slice(0, len(tokens)), caches, caches[0].length)
        decoder = self.compiled_decoder()
        if decoder is None or self.firing_meter is not None or not decoder.usable(self.mode, len(tokens), caches):
            return self._general_logits(np.asarray(tokens), [span], slice(None) if all_logits else slice(-1, None))
        step = TokenStats(steps=1, tokens=len(tokens), bytes_read=self.static_bytes)  # and each FFN's, by its plan
        x = decoder.forward(self._embedded(tokens, [span]), caches, self.mode, step)  # computes its own rotations
        return self._head(x if all_logits else x[-1:], self.host, step)

    def _general_logits(self, tokens: np.ndarray, spans: list["_Span"], logit_rows) -> np.ndarray:
        """The general path: layer by layer, the rows of every span at once (one sequence's block of tokens, or
        a block of each sequence of a batch); the logits of ``logit_rows`` (an index of the rows)."""
        x, where = self._embedded(tokens, spans), self.host
        step = TokenStats(steps=1, tokens=len(tokens), bytes_read=self.static_bytes)  # and each FFN's, by its plan
        rope_of = self._ropes(np.concatenate([span.positions for span in spans]))
        with single_threaded_blas():
            for i, (layer, plan) in enumerate(zip(self.layers, self.ffn_plans[self.mode])):
                backend = layer.dense.backend
                x = move(x, where, backend)
                where = backend
                sequences = [(span.rows, span.caches[i], span.start) for span in spans]
                x = self._layer(i, layer, plan, x, sequences, rope_of(i), step)
        return self._head(x[logit_rows], where, step)

    def _embedded(self, tokens: np.ndarray, spans: list["_Span"]) -> np.ndarray:
        """The tokens' embeddings ``[T, d_model]``, each span's rows at its positions; refused before anything is
        allocated for them where a span does not fit the context window."""
        s = self.spec
        for span in spans:
            if span.start + span.count > self.context_size:
                raise PitoolsError(f"{self.path}: {span.count} tokens after {span.start} do not fit the context window "
                                   f"of {self.context_size} positions")
        x = self.token_embd.dequantize_rows(np.asarray(tokens))
        if (scale := embedding_scale(s)) is not None:
            x = x * np.float32(scale)
        if self.positions is not None:
            x = x + self.positions[np.concatenate([span.positions for span in spans]) + s.position_offset]
        return x

    def _head(self, x, where, step: TokenStats) -> np.ndarray:
        """The logits of the rows ``x`` (on ``where``), on the host; ``step`` is counted."""
        head = self.head_backend
        x = move(x, where, head)
        if self.output_norm is not None:
            x = self._norm(self.output_norm, x)
        self.stats.add(step)
        return output_logits(self.spec, move(head.matmul(self.output, x), head, self.host))

    def _refuse_damaged_file(self) -> NoReturn:
        """Logits that are not finite: name the tensor of the file that holds a NaN or an infinity. The search reads
        the whole file, which no load could afford, so it is made only now: the tensors the loader copied (norms,
        biases) were checked then, and a damaged matrix shows here on every path (the compiled decoder's fast
        floating point turns a NaN into inf or NaN, never an exception: ``kernels.numba_kernels.FAST_FLOATS``)."""
        model = open_model_file(self.path)
        check_finite(model, model.tensors)
        raise PitoolsError(f"{self.path}: the model's logits are not finite (NaN or infinity), though every weight in "
                           "the file is: its activations overflowed, or the file changed while it was being read")

    def _ropes(self, positions: np.ndarray):
        """``rope_of(i)``: layer ``i``'s cos/sin tables for the rows at ``positions`` (None without rotary
        embeddings), made once per (theta, scaling): one set, or Gemma 3's global and local ones."""
        s, ropes = self.spec, {}

        def rope_of(i: int):
            theta, scaling = s.layer_rope(i)
            if theta is not None and (theta, scaling) not in ropes:
                ropes[theta, scaling] = rope_tables(positions, s.head_dim, theta, scaling, self.context_size,
                                                    np.float32)
            return ropes.get((theta, scaling))

        return rope_of

    def general_layer(self, i: int, x: np.ndarray, cache: KVCache, step: TokenStats) -> np.ndarray:
        """Layer ``i`` on the general path for the tokens ``x`` (host ``[T, d_model]``) after what ``cache``
        holds, back on the host: a layer the compiled decoder leaves to this path (``layer_refusal``)."""
        backend, start = self.layers[i].dense.backend, cache.length
        with single_threaded_blas():
            out = self._layer(i, self.layers[i], self.ffn_plans[self.mode][i], move(x, self.host, backend),
                              [(slice(0, len(x)), cache, start)], self._ropes(np.arange(start, start + len(x)))(i),
                              step)
        return move(out, backend, self.host)

    def compiled_decoder(self):
        """The compiled one-token decode path (``compiled_decode.CompiledDecoder``), built on first use; None
        when this model or machine cannot use it, or ``compiled_decoding`` is off (then every step takes
        ``_layer``)."""
        if not self.compiled_decoding or kernels.reference_chosen():  # (not remembered: the choice may change)
            return None
        if self._decoder is _UNBUILT:
            try:
                from powerinfer_tools.runtime.compiled_decode import CompiledDecoder
            except ImportError:  # numba missing: the kernels fall back to NumPy as well
                self._decoder = None
            else:
                self._decoder = CompiledDecoder.build(self)
        return self._decoder

    def decode_refusal(self) -> str | None:
        """Why a decoded token (one token, in this FFN mode) takes the general path, in a few words, or None
        when the compiled decoder takes it."""
        decoder = self.compiled_decoder()
        if decoder is not None:
            return decoder.step_refusal(self.mode, 1, 0)
        if not self.compiled_decoding:
            return "compiled decoding turned off"
        if (reason := kernels.unavailable_reason()) is not None:  # before compiled_decode: it needs numba
            return f"compiled kernels not in use: {reason}"
        from powerinfer_tools.runtime.compiled_decode import refusal

        # The last words stand for a refusal of compiled_decoder()'s own that none of these names.
        return refusal(self) or "the compiled decoder is not in use"

    def layer_paths(self) -> list[str]:
        """Per layer, which path computes it for a decoded token: ``compiled decoder``, or ``general path
        (why)``: the whole token's reason, or the layer's own where the decoder leaves that layer to it."""
        reason = self.decode_refusal()
        reasons = [reason] * len(self.layers) if reason is not None else self.compiled_decoder().general
        return ["compiled decoder" if r is None else f"general path ({r})" for r in reasons]

    def decode_path(self) -> str:
        """Which path decodes a token: ``compiled decoder`` (``, but layers 2, 5 by the general path (why)``
        where it leaves some to it), or ``general path (why)``."""
        reason = self.decode_refusal()
        if reason is not None:
            return f"general path ({reason})"
        general = [(i, r) for i, r in enumerate(self.compiled_decoder().general) if r is not None]
        if not general:
            return "compiled decoder"
        label = "layer" if len(general) == 1 else "layers"
        return (f"compiled decoder, but {label} {', '.join(str(i) for i, _ in general)} by the general path "
                f"({general[0][1]})")

    def execution_report(self) -> list[str]:
        """Lines saying which path and kernels compute each part of this model, as loaded and in its FFN mode
        (``runtime/execution_report.py``): the kernels, each group of alike layers, the output head, prompts."""
        from powerinfer_tools.runtime.execution_report import execution_report

        return execution_report(self)

    def _layer(self, i: int, layer: RuntimeLayer, plan: FFNPlan, x, sequences: list[tuple], rope, step: TokenStats):
        """Layer ``i`` for the rows ``x``; ``sequences``: (their rows, the layer's cache they follow, its length)
        of each sequence the rows belong to; ``rope``: every row's rotation tables (``_attention``)."""
        d = layer.dense

        def ffn(h, residual):
            if plan.experts:
                return self._mixture(layer, plan, h, residual, step)
            out = self._ffn(layer, plan, 0, layer.partitions, d.predictor, h, residual, step)
            return out + d.biases["down"] if "down" in d.biases else out

        post_norms = None if d.post_attn_norm is None else (partial(self._norm, d.post_attn_norm),
                                                            partial(self._norm, d.post_ffn_norm))
        return decoder_layer(x, lambda h: self._attention(i, d, h, sequences, rope), ffn,
                             partial(self._norm, d.attn_norm), partial(self._norm, d.ffn_norm), self.spec.pre_norm,
                             post_norms)

    def _attention(self, i: int, d: DenseBlock, h, sequences: list[tuple], rope):
        """Attention of the rows ``h``: the projections, head norms and rotations (by ``rope``'s tables) of every
        row at once, then each sequence's rows (``rows``, a slice) stored in its ``cache`` and attending over it
        from position ``start``: a batch's step of one token per sequence in one call (``attention_each``)."""
        b, backend = d.biases, d.backend

        def project(w: QuantMatrix | InterleavedQ4, key: str):
            y = backend.matmul(w, h)
            return y + b[key] if key in b else y

        qk_norms = None if d.q_norm is None else (partial(self._norm, d.q_norm), partial(self._norm, d.k_norm))
        rotate = None if rope is None else partial(stored_rotation(self.spec), cos=backend.xp.asarray(rope[0]),
                                                   sin=backend.xp.asarray(rope[1]))
        q, k, v = attention_heads(self.spec, project(d.wq, "q"), project(d.wk, "k"), project(d.wv, "v"), rotate,
                                  qk_norms)
        stored = []
        for rows, cache, _ in sequences:
            stored.append(cache.store(0, k[rows], v[rows]))
            cache.advance(rows.stop - rows.start)
        window, scale, cap = self.spec.layer_window(i), self.spec.attention_scale, self.spec.attn_logit_softcapping
        if len(sequences) > 1 and len(h) == len(sequences):
            out = backend.attention_each(q, stored, window, scale, cap)
        else:
            outs = [backend.attention(q[rows], keys, values, start, window, scale, cap)
                    for (rows, _, start), (keys, values) in zip(sequences, stored)]
            out = outs[0] if len(outs) == 1 else backend.xp.concatenate(outs)
        out = backend.matmul(d.wo, out)
        return out + b["o"] if "o" in b else out

    # -- FFN: each layer's as its plan for the mode says (``ffn_plan``) ---------------------------------------

    def _mixture(self, layer: RuntimeLayer, plan: FFNPlan, h, residual, step: TokenStats):
        """A mixture of experts (``models.layers.mix_experts``): each expert computes, as one FFN, the tokens
        the router sends it."""

        def expert_output(e: int, tokens):
            expert = layer.experts[e]
            return self._ffn(layer, plan, e, expert.partitions, expert.predictor, h[tokens], residual[tokens], step)

        return mix_experts(h @ layer.router.T, self.spec.n_experts_used, len(layer.experts), expert_output, h)

    def _ffn(self, layer: RuntimeLayer, plan: FFNPlan, unit: int, partitions: list[FFNPartition],
             predictor: Optional[Predictor], h, residual, step: TokenStats):
        """One FFN (the layer's, or its expert ``unit``'s) over the tokens ``h``, its neurons split in
        ``partitions``: the rules' (``thresholded_ffn``) or the neurons ``_select`` chooses; counts what it reads
        (``FFNPlan.bytes_read``)."""
        step.neurons_total += plan.d_ff * h.shape[0]
        if plan.choice.thresholded:
            meter = None
            if self.firing_meter is not None:  # the whole gate's choice, metered as a predictor's would be
                meter = partial(self.firing_meter.add, layer.index, fired=self._firing(layer, partitions, h))
            own = (None, tokens_own_up) if reads_every_down_row(plan, h.shape[0]) else (tokens_own_neurons, None)
            out, rows, down_rows = _thresholded().ffn(self.spec.ffn, plan, partitions, h, layer.dense.backend,
                                                      self.host, step, *own, meter=meter)
        else:
            active, mask = self._select(layer, plan, partitions, predictor, h, residual)
            out, rows = self._compute(layer, partitions, h, active, mask, step)
            down_rows = rows
        step.bytes_read += plan.bytes_read(rows, down_rows, unit)
        return out

    def _select(self, layer: RuntimeLayer, plan: FFNPlan, partitions: list[FFNPartition],
                predictor: Optional[Predictor], h, residual):
        """Which neurons to compute, by the plan's choice (every one, the predictor's or, oracle, those that
        fire): (active global ids, per-token mask over them or None).

        The predictor reads ``residual``, the stream entering the FFN block before its
        norm, as PowerInfer's runtime feeds it (``ffn_inp``).
        """
        if plan.choice is Choice.EVERY:
            return np.arange(plan.d_ff), None
        if plan.choice is Choice.PREDICTOR:
            if predictor is None:
                raise RuntimeError("sparse mode needs predictors in the model file")
            chosen = move(predictor(residual), layer.dense.backend, self.host)
            if self.firing_meter is not None:
                self.firing_meter.add(layer.index, chosen, self._firing(layer, partitions, h))
        else:
            chosen = self._firing(layer, partitions, h)
        active = np.flatnonzero(chosen.any(axis=0))
        return active, chosen[:, active]

    def _firing(self, layer: RuntimeLayer, partitions: list[FFNPartition], h) -> np.ndarray:
        """The neurons that truly fire: computed from every partition's full gate/up (oracle mode)."""
        fired = np.zeros((h.shape[0], layer.d_ff), dtype=bool)
        for p in partitions:
            if p.cache is not None:
                raise PitoolsError("oracle mode computes every neuron to find those that fire: it cannot run under "
                                   "a RAM budget (--ram)")
            xh = move(h, layer.dense.backend, p.backend)
            act = move(p.activations(self.spec.ffn, xh, p.neurons), p.backend, self.host)
            fired[:, p.neurons] = act != 0
        return fired

    def _compute(self, layer: RuntimeLayer, partitions: list[FFNPartition], h, active: np.ndarray, mask,
                 step: TokenStats):
        """The FFN's output for the tokens ``h`` from the ``active`` neurons (``mask``: each token's of them, or
        None: all for all), and how many neuron rows that read."""
        home, n_tokens = layer.dense.backend, h.shape[0]
        work, rows = [], 0
        for p in partitions:
            mine = np.isin(active, p.neurons, assume_unique=True)
            n_rows = int(mine.sum())
            part_mask = None if mask is None else mask[:, mine]
            computed = n_rows * n_tokens if mask is None else int(part_mask.sum())
            step.neurons_active += computed
            step.neurons_on_device += computed if p.backend.is_device else 0
            rows += n_rows
            work.append((p, active[mine], part_mask))

        def run(p: FFNPartition, ids: np.ndarray, part_mask):
            if p.cache is None:
                return compute(p, ids, part_mask)
            before = p.cache.counters.snapshot()
            out = compute_cached(p.cache, ids, lambda chosen: compute(
                p, ids[chosen], None if part_mask is None else part_mask[:, chosen]))
            step.add_cache_use(p.cache.counters.since(before))
            return out

        def compute(p: FFNPartition, ids: np.ndarray, part_mask):
            if part_mask is not None and n_tokens > 1:
                out = tokens_own_neurons(self.spec.ffn, p, h, ids, part_mask)
                if out is not None:
                    return out
            xh = move(h, home, p.backend)
            if part_mask is not None:
                part_mask = p.backend.xp.asarray(part_mask, dtype=np.float32)
            return move(p.compute(self.spec.ffn, xh, ids, part_mask), p.backend, home)

        if len(work) == 1:
            return run(*work[0]), rows
        # The device partition runs in a worker thread while the host computes its own;
        # NumPy and CuPy release the GIL in their kernels, so the two overlap.
        on_device = self._pool.submit(run, *work[0])
        out = sum(run(*w) for w in work[1:])
        return out + on_device.result(), rows


def _thresholded():
    """``runtime.thresholded_ffn``, imported where a model with thresholds runs."""
    from powerinfer_tools.runtime import thresholded_ffn

    return thresholded_ffn


# A block of tokens computes each token's own neurons (``tokens_own_neurons``) while they are fewer than this
# share of the neurons on average; above it, the union of their neurons with the products' matrix kernels
# (``FFNPartition.compute``), whose time hardly depends on the share. On the TinyLlama shape's 128-token prompt
# the two cross between 28% and 39% (`python examples/prompt_paths.py MODEL.powerinfer.gguf` times both at each
# share, on the realistic synthetic model, whose predictors compute 56% of the neurons).
OWN_NEURONS_DENSITY = 0.3


# A block of at least this many tokens of an FFN whose whole gate chooses its neurons (a ReLU family's:
# ``Choice.WHOLE_GATE``) computes each token's own up products, then reads every row of the down projection with
# the matrix kernels (``thresholded_ffn``; a neuron a token did not keep adds relu's exact zero): from about here
# that is faster than each token's own down rows (``tokens_own_neurons``) and than dense mode's every neuron
# (``python examples/prompt_modes.py MODEL.powerinfer.gguf`` times the three by length; docs/lab/kernels.md: on
# the realistic TinyLlama-shape file, whose tokens keep a tenth of the neurons, from 48 tokens; on a 4-layer
# LLaMA-7B-shape one, even at 64, ahead from 128).
EVERY_DOWN_ROW_TOKENS = 64


def reads_every_down_row(plan: FFNPlan, n_tokens: int) -> bool:
    """Whether a block of ``n_tokens`` computes ``plan``'s layer from its tokens' own up products and every down
    row (``EVERY_DOWN_ROW_TOKENS``): its rows in memory (under a RAM budget every row would stream from disk) and
    on the host."""
    return (plan.choice is Choice.WHOLE_GATE and n_tokens >= EVERY_DOWN_ROW_TOKENS and plan.cache is Cache.NONE
            and plan.device is None)


def tokens_own_neurons(kind, p: FFNPartition, h: np.ndarray, ids: np.ndarray, mask: np.ndarray, gate_pre=None,
                       columns=slice(None)):
    """A partition's output for a block of tokens, each computing only the neurons ``mask`` gives it
    (``kernels.batched``; ``gate_pre``: their gate products, where the gate chose them; of both, the ``columns``
    that are ``ids``'s, every one they choose among them): a prompt's union of predicted neurons is nearly all of
    them, ~8x the work of each token's own. None where the tokens choose too many of the neurons for it to pay
    (``OWN_NEURONS_DENSITY``; none at all: nothing to compute either way) or that path does not apply
    (``computes_tokens_own_neurons``): decided before the columns are copied out."""
    chosen = np.count_nonzero(mask)
    if not chosen or chosen >= OWN_NEURONS_DENSITY * len(h) * len(ids):
        return None
    if not computes_tokens_own_neurons(p, gate_pre is not None):
        return None
    from powerinfer_tools.kernels import batched
    return batched.selected_ffn(kind, p.gate, p.up, p.down_t, p.row_of[ids], h, mask[:, columns],
                                None if gate_pre is None else gate_pre[:, columns])


def tokens_own_up(p: FFNPartition, h: np.ndarray, mask: np.ndarray, gate_pre: np.ndarray):
    """A partition's up products ``[T, len(p.neurons)]`` for a block of tokens, each token's only where ``mask``
    gives it the neuron (``kernels.batched.selected_up``; ``gate_pre``: every neuron's gate products), 0 elsewhere;
    None where that path does not apply (``computes_tokens_own_neurons``)."""
    if not computes_tokens_own_neurons(p, gate_given=True):
        return None
    from powerinfer_tools.kernels import batched
    return batched.selected_up(p.up, p.row_of[p.neurons], h, mask, gate_pre)


def computes_tokens_own_neurons(p: FFNPartition, gate_given: bool = False) -> bool:
    """Whether a block of tokens with their own neuron choices computes each token's own neurons of ``p``
    (``kernels.batched``): a CPU partition, the compiled kernels in use, no biases, a gated FFN whose
    matrices ``batched.handles`` (``gate_given``: their gate products already computed)."""
    if p.backend.is_device or not kernels.available():
        return False
    from powerinfer_tools.kernels import batched
    return p.gate_bias is None and p.up_bias is None and batched.handles(p.gate, p.up, p.down_t, gate_given)
