"""The layer math of both engines: norms, rotary embeddings, attention over a KV cache, the FFN
kinds, and how a decoder layer arranges them around its residual stream.

The reference engine (``models.llama``, ``models.opt``) and the runtime's general path
(``runtime.engine.RuntimeModel``) compute with these; they differ in where weights live and how a
product is taken, which they pass in. (The runtime's compiled one-token decode path,
``runtime.compiled_decode``, is the one specialization that does not.)

Weights follow the Hugging Face layout ``[out_features, in_features]``, so a
linear layer is ``x @ W.T``. Activations are ``[tokens, features]``: the engine
runs one sequence at a time, prompt tokens as one block. The functions use the
array module of their inputs, so the runtime runs them on CuPy arrays as well.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, Optional

import numpy as np

from powerinfer_tools.formats import activations
from powerinfer_tools.formats.activation_thresholds import LayerThresholds, kept, only, thresholded
from powerinfer_tools.formats.model_spec import FFNKind, ModelSpec, NormKind
from powerinfer_tools.formats.architecture import RopePairs
from powerinfer_tools.formats.rope import RopeScaling
from powerinfer_tools.formats.soft_cap import soft_capped
from powerinfer_tools.xp import array_namespace


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    variance = (x * x).mean(axis=-1, keepdims=True)
    return x / array_namespace(x).sqrt(variance + eps) * weight


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    centred = x - x.mean(axis=-1, keepdims=True)
    variance = (centred * centred).mean(axis=-1, keepdims=True)
    return centred / array_namespace(x).sqrt(variance + eps) * weight + bias


@dataclass
class Norm:
    """A norm's weights; ``bias`` for LayerNorm only."""

    weight: np.ndarray
    bias: Optional[np.ndarray] = None


def normalize(kind: NormKind, norm: Norm, x: np.ndarray, eps: float) -> np.ndarray:
    if kind is NormKind.RMS:
        return rms_norm(x, norm.weight, eps)
    return layer_norm(x, norm.weight, norm.bias, eps)


def linear(x: np.ndarray, weight: np.ndarray, bias: Optional[np.ndarray] = None) -> np.ndarray:
    y = x @ weight.T
    return y if bias is None else y + bias


def embedding_scale(spec: ModelSpec) -> float | None:
    """What token embeddings are multiplied by before the first layer (Gemma: sqrt(d_model)); None: nothing."""
    return float(np.sqrt(spec.d_model)) if spec.architecture.scaled_embeddings else None


def rope_tables(positions: np.ndarray, head_dim: int, theta: float, scaling: RopeScaling, context_size: int,
                dtype) -> tuple:
    """cos/sin tables ``[tokens, head_dim]`` in the rotate-half layout Hugging Face LLaMA uses, with the model's
    scaling of the frequencies for a run whose context window holds ``context_size`` positions
    (``formats/rope.py``)."""
    inv_freq, factor = scaling.frequencies(theta, head_dim, context_size)
    angles = np.outer(positions.astype(np.float64), inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)
    return (np.cos(angles) * factor).astype(dtype), (np.sin(angles) * factor).astype(dtype)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate ``x [tokens, heads, head_dim]``: pairs are (i, i + head_dim/2), as in HF LLaMA."""
    half = x.shape[-1] // 2
    rotated = array_namespace(x).concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def apply_rope_adjacent(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate pairs (2i, 2i+1), as ggml's normal rope mode does.

    llama.cpp's converter permutes the rows of LLaMA's q/k projections so that this
    layout computes the same attention as Hugging Face's rotate-half. ``cos/sin``
    are the tables of ``rope_tables`` (their two halves repeat the same angles).
    """
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = array_namespace(x).empty_like(x)
    out[..., 0::2] = even * c - odd * s
    out[..., 1::2] = even * s + odd * c
    return out


def stored_rotation(spec: ModelSpec) -> Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    """``apply_rope`` or ``apply_rope_adjacent``: the rotation that q and k need as a GGUF file of
    ``spec``'s architecture stores them (its table's ``rope_pairs``, which llama.cpp's rope type and
    the converter's row order follow). The reference engine, on checkpoint weights, always rotates halves."""
    return apply_rope_adjacent if spec.architecture.rope_pairs is RopePairs.ADJACENT else apply_rope


class KVCache:
    """Keys and values of every layer for one sequence, grown by doubling."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype, capacity: int = 64, xp=np):
        shape = (n_layers, capacity, n_kv_heads, head_dim)
        self.keys = xp.zeros(shape, dtype=dtype)
        self.values = xp.zeros(shape, dtype=dtype)
        self.length = 0  # tokens stored, committed by advance()

    def store(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Append this step's ``k, v [tokens, kv_heads, head_dim]``; return all keys and values so far."""
        end = self.length + k.shape[0]
        if end > self.keys.shape[1]:
            self._grow(end)
        self.keys[layer, self.length : end] = k
        self.values[layer, self.length : end] = v
        return self.keys[layer, :end], self.values[layer, :end]

    def advance(self, n_tokens: int) -> None:
        self.length += n_tokens

    def prefix(self, n_tokens: int) -> "KVCache":
        """A cache of its own holding this one's first ``n_tokens`` positions (a copy: the two go on apart)."""
        xp = array_namespace(self.keys)
        copy = KVCache(self.keys.shape[0], *self.keys.shape[2:], self.keys.dtype, capacity=max(2 * n_tokens, 64), xp=xp)
        copy.keys[:, :n_tokens] = self.keys[:, :n_tokens]
        copy.values[:, :n_tokens] = self.values[:, :n_tokens]
        copy.length = n_tokens
        return copy

    @property
    def nbytes(self) -> int:
        """The memory its keys and values take, room to grow included."""
        return self.keys.nbytes + self.values.nbytes

    def _grow(self, needed: int) -> None:
        # The stored positions alone are copied (np.pad copied every row and filled the rest in Python, as each
        # layer's cache grows from 64 to 128 positions in a 128-token prompt).
        capacity = max(needed, 2 * self.keys.shape[1])
        xp = array_namespace(self.keys)
        for name in ("keys", "values"):
            old = getattr(self, name)
            grown = xp.zeros((old.shape[0], capacity, *old.shape[2:]), dtype=old.dtype)
            grown[:, : self.length] = old[:, : self.length]
            setattr(self, name, grown)


def score_scale(head_dim: int, scale: Optional[float]) -> float:
    """What attention multiplies its scores by: ``scale``, or 1/sqrt(head_dim) where the model names none."""
    return head_dim ** -0.5 if scale is None else scale


def attention(
    q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int, sliding_window: Optional[int] = None,
    scale: Optional[float] = None, softcap: Optional[float] = None,
) -> np.ndarray:
    """Causal grouped-query attention.

    ``q [T, heads, hd]`` holds queries at absolute positions ``start .. start+T-1``;
    ``keys/values [S, kv_heads, hd]`` hold positions ``0 .. S-1`` (S = start + T).
    Scores are multiplied by ``scale`` (default 1/sqrt(hd)), then soft-capped at ``softcap``
    where given (Gemma 2). Returns ``[T, heads * hd]``.
    """
    xp = array_namespace(q)
    n_tokens, n_heads, head_dim = q.shape
    n_kv = keys.shape[1]
    group = n_heads // n_kv
    # [kv_heads, group * T, hd] @ [kv_heads, hd, S]: each KV head serves `group` query heads, all in one
    # batched product (einsum contracts these without BLAS: an order of magnitude slower on a 128-token prompt).
    qg = q.reshape(n_tokens, n_kv, group, head_dim).transpose(1, 2, 0, 3).reshape(n_kv, group * n_tokens, head_dim)
    scale = q.dtype.type(score_scale(head_dim, scale))
    scores = (qg @ keys.transpose(1, 2, 0)).reshape(n_kv, group, n_tokens, -1)
    # The softmax in place, in the product's own array: a new array at each step made a 512-token prompt of the
    # TinyLlama-shaped model slower and its peak RSS 32 MiB larger (docs/lab/real-models.md).
    scores *= scale
    if softcap is not None:
        scores = soft_capped(scores, q.dtype.type(softcap))
    if n_tokens > 1 or (sliding_window is not None and keys.shape[0] > sliding_window):  # (one query sees all)
        query_pos = start + xp.arange(n_tokens)[:, None]
        key_pos = xp.arange(keys.shape[0])[None, :]
        visible = key_pos <= query_pos
        if sliding_window is not None:
            visible &= key_pos > query_pos - sliding_window
        scores += xp.where(visible, q.dtype.type(0), q.dtype.type(-np.inf))  # the positions a query may not see
    scores -= scores.max(axis=-1, keepdims=True)
    weights = xp.exp(scores, out=scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    out = weights.reshape(n_kv, group * n_tokens, -1) @ values.transpose(1, 0, 2)  # [kv_heads, group * T, hd]
    return out.reshape(n_kv, group, n_tokens, head_dim).transpose(2, 0, 1, 3).reshape(n_tokens, n_heads * head_dim)


def attention_each(q: np.ndarray, stored: list[tuple[np.ndarray, np.ndarray]], sliding_window: Optional[int] = None,
                   scale: Optional[float] = None, softcap: Optional[float] = None) -> np.ndarray:
    """``[B, heads * hd]``: a batch's step, each of B sequences' one query ``q[b] [heads, hd]`` at its last
    position over its own ``stored[b]`` (keys, values ``[S_b, kv_heads, hd]``): ``attention`` per sequence."""
    return array_namespace(q).concatenate([attention(q[b : b + 1], keys, values, len(keys) - 1, sliding_window, scale,
                                                     softcap)
                                           for b, (keys, values) in enumerate(stored)])


def output_logits(spec: ModelSpec, logits: np.ndarray) -> np.ndarray:
    """The logits a model gives, from its output head's products ``logits``: soft-capped where it caps them
    (Gemma 2's ``final_logit_softcapping``), else those. Every engine's logits pass through here."""
    cap = spec.final_logit_softcapping
    return logits if cap is None else soft_capped(logits, logits.dtype.type(cap))


Rotation = Callable[[np.ndarray], np.ndarray]  # rotary embedding of ``[T, heads, head_dim]``
KVStore = Callable[[np.ndarray, np.ndarray], tuple]  # this step's (k, v) -> every key and value so far


HeadNorm = Callable[[np.ndarray], np.ndarray]  # a norm over each head of ``[T, heads, head_dim]``
Attend = Callable[..., np.ndarray]  # ``attention`` or another computing it (a CPU backend's, for prompts)


def self_attention(spec: ModelSpec, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, store: KVStore,
                   start: int, rotate: Optional[Rotation] = None,
                   qk_norms: Optional[tuple[HeadNorm, HeadNorm]] = None, attend: Attend = attention) -> np.ndarray:
    """Causal self-attention ``[T, heads * hd]`` of layer ``layer``'s projected ``q [T, heads * hd]`` and
    ``k, v [T, kv_heads * hd]`` at positions from ``start``: their heads (``attention_heads``), k and v appended to
    the cache through ``store``, ``attend`` within the layer's window (``ModelSpec.layer_window``), its scores
    scaled and soft-capped as the model says. The output projection is the caller's."""
    q, k, v = attention_heads(spec, q, k, v, rotate, qk_norms)
    keys, values = store(k, v)
    return attend(q, keys, values, start, spec.layer_window(layer), spec.attention_scale, spec.attn_logit_softcapping)


def attention_heads(spec: ModelSpec, q: np.ndarray, k: np.ndarray, v: np.ndarray, rotate: Optional[Rotation] = None,
                    qk_norms: Optional[tuple[HeadNorm, HeadNorm]] = None) -> tuple[np.ndarray, ...]:
    """Projected ``q [T, heads * hd]``, ``k, v [T, kv_heads * hd]`` split into heads, q and k normed per head
    (``qk_norms``, Gemma 3) and rotated (``rotate``, RoPE models). Each row on its own: the rows of several
    sequences go through at once (a batch's, each rotated by its own positions' tables)."""
    n = q.shape[0]
    q = q.reshape(n, spec.n_heads, spec.head_dim)
    k = k.reshape(n, spec.n_kv_heads, spec.head_dim)
    v = v.reshape(n, spec.n_kv_heads, spec.head_dim)
    if qk_norms is not None:
        q, k = qk_norms[0](q), qk_norms[1](k)
    if rotate is not None:
        q, k = rotate(q), rotate(k)
    return q, k, v


def decoder_layer(x: np.ndarray, attend: Callable, feed_forward: Callable, attn_norm: Callable, ffn_norm: Callable,
                  pre_norm: bool, post_norms: Optional[tuple[Callable, Callable]] = None) -> np.ndarray:
    """The residual stream ``x`` after one layer. Pre-norm (LLaMA, most OPT): ``x + f(norm(x))`` for
    attention then FFN, with ``post_norms`` (Gemma 2 and 3) ``x + post(f(norm(x)))``; post-norm (OPT-350m):
    ``norm(x + f(x))``. ``attend(h)``, ``feed_forward(h, residual)``: the FFN also gets the stream
    entering its block, before its norm (what predictors read)."""
    if pre_norm:
        post_attn, post_ffn = post_norms or (lambda v: v, lambda v: v)
        x = x + post_attn(attend(attn_norm(x)))
        return x + post_ffn(feed_forward(ffn_norm(x), x))
    x = attn_norm(x + attend(x))
    return ffn_norm(x + feed_forward(x, x))


@dataclass
class FFNWeights:
    """One layer's FFN. ``gate`` is None for OPT's ungated ReLU FFN (``up`` is fc1, ``down`` fc2)."""

    up: np.ndarray  # [d_ff, d_model]
    down: np.ndarray  # [d_model, d_ff]
    gate: Optional[np.ndarray] = None  # [d_ff, d_model]
    gate_bias: Optional[np.ndarray] = None
    up_bias: Optional[np.ndarray] = None
    down_bias: Optional[np.ndarray] = None


@dataclass
class MoEWeights:
    """One layer's mixture of experts: a router ``[n_experts, d_model]`` and each expert's FFN."""

    router: np.ndarray
    experts: list[FFNWeights]


@dataclass
class FFNTrace:
    """What a profiling hook sees of one layer's FFN (or one expert's) for a block of tokens."""

    layer: int
    ffn_input: np.ndarray  # [T, d_model], after the norm: what the FFN multiplies
    # [T, d_model] the residual stream entering the FFN block, before its norm (the same as
    # ffn_input for post-norm models): what PowerInfer's predictors read (``ffn_inp``)
    residual: np.ndarray
    gate_pre: Optional[np.ndarray]  # [T, d_ff] gate projection before activation (None for OPT)
    up_pre: np.ndarray  # [T, d_ff] up projection (fc1 + bias for OPT) before activation
    activated: np.ndarray  # [T, d_ff] the values multiplied into the down projection
    # A mixture of experts: whose FFN this is, and which tokens of the block (ascending) were routed to it.
    expert: Optional[int] = None
    tokens: Optional[np.ndarray] = None

    @property
    def fired(self) -> np.ndarray:
        """Boolean ``[T, d_ff]``: which neurons fire (non-zero activated value)."""
        return self.activated != 0


FFNHook = Callable[[FFNTrace], None]
# Given a layer, its residual (as in FFNTrace, [T, d_model]) and which neurons truly fire on these
# tokens ([T, d_ff] bool, from the activations the FFN has computed), the neurons to compute
# ([T, d_ff] bool), or None for all.
NeuronSelector = Callable[[int, np.ndarray, np.ndarray], Optional[np.ndarray]]


def gate_activation(kind: FFNKind) -> Callable[[np.ndarray], np.ndarray]:
    """A gated FFN's activation of its gate product (``formats/activations.py``); also what CATS thresholds the
    magnitude of (a ReLU family's relu: at threshold 0, exactly the neurons that fire)."""
    if not kind.gated:
        raise ValueError(f"{kind.value} has no gate")
    return partial(activations.activation, activations.NUMBERS[kind])


def activate(kind: FFNKind, gate_pre: Optional[np.ndarray], up_pre: np.ndarray) -> np.ndarray:
    if kind is FFNKind.RELU:
        return activations.activation(activations.RELU, up_pre)
    return gated(kind, gate_activation(kind)(gate_pre), up_pre)


def gated(kind: FFNKind, gate: np.ndarray, up_pre: np.ndarray) -> np.ndarray:
    """A gated FFN's activations from its gate's activated values and its up products (dReLU: up's relu'd)."""
    return activations.gated(activations.NUMBERS[kind], gate, up_pre)


def route(router_logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Mixtral's routing (transformers' ``MixtralTopKRouter``): softmax over the experts, the ``k``
    most probable, their probabilities renormalised to sum to 1. Returns ``(experts [T, k] int,
    weights [T, k])``, most probable first; of equal probabilities the lower expert index wins."""
    xp = array_namespace(router_logits)
    shifted = router_logits - router_logits.max(axis=-1, keepdims=True)
    probs = xp.exp(shifted)
    probs /= probs.sum(axis=-1, keepdims=True)
    experts = xp.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = xp.take_along_axis(probs, experts, axis=-1)
    return experts, weights / weights.sum(axis=-1, keepdims=True)


def mix_experts(router_logits: np.ndarray, k: int, n_experts: int, expert_output: Callable, x: np.ndarray
                ) -> np.ndarray:
    """The output of a mixture of experts for the tokens ``x [T, d_model]`` whose router logits are
    ``router_logits [T, n_experts]``: each token's ``k`` routed experts (``route``), their outputs weighted by
    the router and summed. ``expert_output(e, tokens)`` is expert ``e``'s FFN output ``[len(tokens), d_model]``
    for the tokens routed to it (indices into ``x``), called once per expert with any. Every engine mixes
    its experts here: the reference engine, the runtime's general path and its compiled one-token path."""
    xp = array_namespace(x)
    experts, weights = route(router_logits, k)
    out = xp.zeros_like(x)
    for e in range(n_experts):
        tokens, slot = xp.nonzero(experts == e)  # a token routes to an expert at most once
        if len(tokens):
            out[tokens] += expert_output(e, tokens) * weights[tokens, slot][:, None]
    return out


def mixture_of_experts(kind: FFNKind, w: MoEWeights, k: int, x: np.ndarray, layer: int,
                       hook: Optional[FFNHook] = None, residual: Optional[np.ndarray] = None) -> np.ndarray:
    """A mixture of experts over ``x [T, d_model]`` (``mix_experts``). Each expert runs once on the tokens
    routed to it (the ``hook`` sees them, with the expert)."""
    residual = x if residual is None else residual

    def expert_output(e: int, tokens: np.ndarray) -> np.ndarray:
        traced = None if hook is None else partial(_expert_trace, hook, e, tokens)
        return feed_forward(kind, w.experts[e], x[tokens], layer, traced, residual=residual[tokens])

    return mix_experts(linear(x, w.router), k, len(w.experts), expert_output, x)


def _expert_trace(hook: FFNHook, expert: int, tokens: np.ndarray, trace: FFNTrace) -> None:
    hook(replace(trace, expert=expert, tokens=tokens))


def feed_forward(
    kind: FFNKind,
    w: FFNWeights,
    x: np.ndarray,
    layer: int,
    hook: Optional[FFNHook] = None,
    selector: Optional[NeuronSelector] = None,
    residual: Optional[np.ndarray] = None,
    thresholds: Optional[LayerThresholds] = None,
) -> np.ndarray:
    """One FFN over ``x [T, d_model]``; ``residual`` is the stream before the FFN norm (default ``x``).

    With a ``selector``, neurons it leaves out are treated as not firing (their
    activated value is zeroed), which is what a sparse runtime computes when it
    skips them. With ``thresholds`` (a SiLU model's), their rule decides instead:
    the definition the runtime's kernels are tested against (``formats/activation_thresholds.py``);
    the hook then sees the activations before the rule drops any. This reference path
    still multiplies every row; the runtime is what reads only the selected rows.
    """
    product_input = x if thresholds is None else thresholded(x, thresholds.ffn_in)
    gate_pre = linear(product_input, w.gate, w.gate_bias) if w.gate is not None else None
    up_pre = linear(product_input, w.up, w.up_bias)
    activated = activate(kind, gate_pre, up_pre)
    residual = x if residual is None else residual
    if selector is not None:
        mask = selector(layer, residual, activated != 0)
        if mask is not None:
            activated = only(activated, mask)
    if hook is not None:
        hook(FFNTrace(layer, x, residual, gate_pre, up_pre, activated))
    if thresholds is not None:
        selected = kept(gate_activation(kind)(gate_pre), thresholds.cats)
        activated = thresholded(only(activated, selected), thresholds.ffn_down)
    return linear(activated, w.down, w.down_bias)
