"""What every architecture module provides, and the config-reading helpers they share."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import numpy as np
from gguf import MODEL_TENSOR as T

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.activation_thresholds import ActivationThresholds
from powerinfer_tools.formats.gguf_names import checkpoint_shape, part_rows
from powerinfer_tools.formats.model_spec import ModelSpec
from powerinfer_tools.formats.rope import (YARN_BETA_FAST, YARN_BETA_SLOW, RopeKind, RopeScaling, llama3_factors,
                                           longrope_attention_factor)
from powerinfer_tools.interfaces import Engine, FFNTracer
from powerinfer_tools.models.layers import (
    FFNHook,
    FFNWeights,
    KVCache,
    MoEWeights,
    NeuronSelector,
    Rotation,
    decoder_layer,
    feed_forward,
    linear,
    mixture_of_experts,
    output_logits,
    self_attention,
)


def require(config: dict, key: str, architecture: str) -> Any:
    """A config field the model cannot be built without (ModelSpec checks its type and range)."""
    if key not in config or config[key] is None:
        raise PitoolsError(f"this {architecture} model's config lacks the field {key!r}")
    return config[key]


def optional(config: dict, key: str, default: Any) -> Any:
    """A config field that may be absent or null (ModelSpec checks its type and range)."""
    value = config.get(key)
    return default if value is None else value


def token_id(config: dict, key: str) -> Any:
    """A special token id; of a list (LLaMA-3 lists several end-of-sequence ids) the first."""
    value = config.get(key)
    return value[0] if isinstance(value, list) and value else value


def rope_settings(config: dict, head_dim: Any = None) -> tuple[Any, RopeScaling]:
    """(theta, scaling) from either transformers' v4 or v5 config layout (``formats/rope.py``); ``head_dim``, the
    rotated width, for Llama 3.1's per-pair factors. Which kinds a family allows, ``ModelSpec`` checks."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise PitoolsError(f"rope_scaling must be an object, not {params!r}")
    theta = optional(params, "rope_theta", optional(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    kinds = {kind.value: kind for kind in RopeKind} | {"default": RopeKind.NONE}
    if rope_type not in kinds:
        raise PitoolsError(f"rope scaling type {rope_type!r:.40} is not supported (supported: {', '.join(kinds)})")
    kind = kinds[rope_type]
    if kind is RopeKind.NONE:
        return theta, RopeScaling()
    if kind is RopeKind.LONGROPE:
        return theta, _longrope(config, params)
    factor = params.get("factor")  # ModelSpec checks it
    if factor is None:
        raise PitoolsError(f"{kind.value} rope scaling lacks its 'factor'")
    if kind is RopeKind.LINEAR:
        return theta, RopeScaling(kind, factor)
    if kind is RopeKind.LLAMA3:
        factor = _rope_number(params, "factor", None)  # what the frequency factors are computed from
        if not all(isinstance(v, numbers.Real) and v > 0 for v in (theta, head_dim)):
            raise PitoolsError(f"llama3 rope scaling needs a positive rope_theta and head size, not {theta!r:.20} "
                               f"and {head_dim!r:.20}")
        low, high = _rope_number(params, "low_freq_factor", 1.0), _rope_number(params, "high_freq_factor", 4.0)
        original = _rope_number(params, "original_max_position_embeddings", 8192)
        if not low < high:
            raise PitoolsError(f"llama3 rope scaling's low_freq_factor ({low}) must be below its high_freq_factor "
                               f"({high})")
        return theta, RopeScaling(kind, factor, frequency_factors=llama3_factors(theta, head_dim, factor, low, high,
                                                                                 original))
    _refuse_unapplied_yarn(params)
    original = params.get("original_max_position_embeddings") or config.get("max_position_embeddings")
    return theta, RopeScaling(kind, factor, original_context=original)


def _longrope(config: dict, params: dict) -> RopeScaling:
    """Phi-3's longrope: its two factor lists (ModelSpec checks them), the context it was trained at (Phi-3 configs'
    top-level ``original_max_position_embeddings``, which transformers prefers, or ``rope_scaling``'s) and the
    attention factor of the extension to ``max_position_embeddings``, which llama.cpp's converter writes. transformers
    would take a config's own ``attention_factor``, or derive it from its ``factor``: a config whose value differs is
    refused, as its file would compute another model in llama.cpp."""
    original = config.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    if original is None:
        raise PitoolsError("longrope rope scaling lacks original_max_position_embeddings (the context its short "
                           "factors are for)")
    original = _rope_number({"original_max_position_embeddings": original}, "original_max_position_embeddings", None)
    attention = longrope_attention_factor(_rope_number(config, "max_position_embeddings", None), original)
    if params.get("attention_factor") is not None:
        theirs, said = _rope_number(params, "attention_factor", None), "attention_factor"
    elif params.get("factor") is not None:
        theirs, said = longrope_attention_factor(_rope_number(params, "factor", None) * original, original), "factor"
    else:
        theirs, said = attention, None
    if not math.isclose(theirs, attention, rel_tol=1e-6):
        raise PitoolsError(f"longrope rope scaling with {said}={params[said]!r:.40} is not supported (it sets an "
                           f"attention factor of {theirs:.6g}; llama.cpp's converter writes the one "
                           f"max_position_embeddings implies, {attention:.6g})")
    return RopeScaling(RopeKind.LONGROPE, original_context=original, short_factors=_factor_list(params, "short_factor"),
                       long_factors=_factor_list(params, "long_factor"), attention_factor=attention)


def _factor_list(params: dict, key: str) -> Any:
    """A longrope factor list as a tuple (ModelSpec checks its length and values), or the value as it is."""
    value = params.get(key)
    if value is None:
        raise PitoolsError(f"longrope rope scaling lacks its {key!r}")
    return tuple(value) if isinstance(value, list) else value


def _rope_number(params: dict, key: str, default: Any) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise PitoolsError(f"rope_scaling {key} must be a finite number above 0, not {value!r:.40}")
    return value


# YaRN's settings that llama.cpp reads from no GGUF key (formats/rope.py), and the values it assumes: a config that
# sets another would become a file that llama.cpp computes differently, so it is refused.
_YARN_ASSUMED = {"beta_fast": (None, YARN_BETA_FAST), "beta_slow": (None, YARN_BETA_SLOW), "truncate": (None, True),
                 "attention_factor": (None,), "mscale": (None,), "mscale_all_dim": (None,)}


def _refuse_unapplied_yarn(params: dict) -> None:
    for key, assumed in _YARN_ASSUMED.items():
        if params.get(key) not in assumed:
            raise PitoolsError(f"yarn rope scaling with {key}={params[key]!r:.40} is not supported (llama.cpp's "
                               "GGUF files keep no such setting)")


class CheckpointWeights:
    """Checkpoint tensors for the reference engine, as ``dtype``: each checked against the shape
    config.json implies, and refused when it holds NaN or infinite values (nothing computed from
    them would mean anything, and a profile of them would be silently wrong)."""

    def __init__(self, checkpoint: Checkpoint, dtype, layers: range | None = None):
        self.checkpoint, self.dtype, self.layers = checkpoint, dtype, layers

    def blocks(self, spec: ModelSpec, load: Callable[[int], Block]) -> list[Block | None]:
        """Each layer's block, ``load(layer)``; with ``layers``, None outside that range: a node holding
        part of a model larger than its memory (``cluster/ray_layer_ranges.py``) reads no other layer."""
        held = range(spec.n_layers) if self.layers is None else self.layers
        return [load(i) if i in held else None for i in range(spec.n_layers)]

    def get(self, name: str, *shape: int) -> np.ndarray:
        self.checkpoint.check_weight(name, shape)
        values = np.ascontiguousarray(self.checkpoint.tensor(name, self.dtype))
        self.checkpoint.check_finite(name, values)
        return values

    def maybe(self, name: str, *shape: int) -> np.ndarray | None:
        return self.get(name, *shape) if name in self.checkpoint else None


@dataclass
class Block:
    """One decoder layer's weights; the norms are a weight (RMSNorm) or a ``Norm`` (LayerNorm)."""

    attn_norm: Any
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    bq: np.ndarray | None
    bk: np.ndarray | None
    bv: np.ndarray | None
    bo: np.ndarray | None
    ffn_norm: Any
    ffn: FFNWeights | MoEWeights
    # Further norms: of q and k per head (``[head_dim]``; Qwen3, Gemma 3), after attention and after the FFN
    # (Gemma 2 and 3).
    q_norm: Any = None
    k_norm: Any = None
    post_attn_norm: Any = None
    post_ffn_norm: Any = None


# Block fields -> the tensors of the further norms a family may have.
EXTRA_NORMS = {"q_norm": T.ATTN_Q_NORM, "k_norm": T.ATTN_K_NORM, "post_attn_norm": T.ATTN_POST_NORM,
               "post_ffn_norm": T.FFN_POST_NORM}


def read_weight(w: CheckpointWeights, spec: ModelSpec, tensor: T, layer: int | None = None, part: str = "weight",
                expert: int | None = None) -> np.ndarray:
    """A tensor of ``spec``'s family from the checkpoint, checked against the shape config.json implies; a part of a
    fused tensor (Phi-3's q of its qkv_proj) is its rows of it."""
    row = spec.architecture.row(tensor)
    shape = checkpoint_shape(spec, row) if part == "weight" else checkpoint_shape(spec, row)[:1]
    return w.get(row.hf_name(layer, part, expert), *shape)[part_rows(spec, row, tensor)]


def load_block(w: CheckpointWeights, spec: ModelSpec, layer: int, norm: Callable[[T, int], Any]) -> Block:
    """Layer ``layer`` of a checkpoint of ``spec``'s family; ``norm(tensor, layer)`` reads a norm."""
    arch = spec.architecture

    def projection(tensor: T) -> tuple[np.ndarray, np.ndarray | None]:
        has_bias = arch.hf_name(tensor, layer, "bias") in w.checkpoint
        return read_weight(w, spec, tensor, layer), read_weight(w, spec, tensor, layer, "bias") if has_bias else None

    (wq, bq), (wk, bk) = projection(T.ATTN_Q), projection(T.ATTN_K)
    (wv, bv), (wo, bo) = projection(T.ATTN_V), projection(T.ATTN_OUT)
    if spec.moe:
        ffn = MoEWeights(read_weight(w, spec, T.FFN_GATE_INP, layer),
                         [_expert(w, spec, layer, e) for e in range(spec.n_experts)])
    else:
        gate, gate_bias = projection(T.FFN_GATE) if spec.ffn.gated else (None, None)
        (up, up_bias), (down, down_bias) = projection(T.FFN_UP), projection(T.FFN_DOWN)
        ffn = FFNWeights(up, down, gate=gate, gate_bias=gate_bias, up_bias=up_bias, down_bias=down_bias)
    extra_norms = {field: norm(tensor, layer) for field, tensor in EXTRA_NORMS.items() if arch.has(tensor)}
    return Block(attn_norm=norm(T.ATTN_NORM, layer), wq=wq, wk=wk, wv=wv, wo=wo, bq=bq, bk=bk, bv=bv, bo=bo,
                 ffn_norm=norm(T.FFN_NORM, layer), ffn=ffn, **extra_norms)


def _expert(w: CheckpointWeights, spec: ModelSpec, layer: int, expert: int) -> FFNWeights:
    """One expert's gated FFN (experts have no biases)."""
    def weight(tensor: T) -> np.ndarray:
        return read_weight(w, spec, tensor, layer, expert=expert)

    return FFNWeights(weight(T.FFN_UP_EXP), weight(T.FFN_DOWN_EXP), gate=weight(T.FFN_GATE_EXP))


@dataclass(frozen=True)
class Stages:
    """One call of a forward pass in steps: ``layers[i](x)`` is the residual stream after layer ``i`` given the
    one entering it, and may run again on the same input (its keys and values overwrite the same cache slots);
    ``finish(x)`` the logits of the stream after the last layer."""

    embedded: np.ndarray  # the tokens' embeddings: the stream entering layer 0
    layers: list[Callable[[np.ndarray], np.ndarray]]
    finish: Callable[[np.ndarray], np.ndarray]


class DecoderModel(Engine, FFNTracer):
    """The reference engine: a decoder-only language model evaluated in NumPy, one sequence at a time.

    ``ffn_hook`` (if set) sees every FFN's input and activations; ``neuron_selector``
    (if set) restricts which neurons each FFN computes; ``activation_thresholds`` (if set)
    run a SiLU model's FFNs by their rule (``layers.feed_forward``).
    They exist so profiling and sparse evaluation can use the reference model unchanged.
    """

    spec: ModelSpec
    dtype: np.dtype

    def __init__(self) -> None:
        self.ffn_hook: Optional[FFNHook] = None
        self.neuron_selector: Optional[NeuronSelector] = None
        self.activation_thresholds: Optional[ActivationThresholds] = None
        # Off while profiling and calibrating, which read the FFNs through the hook: no output head, which
        # is a fifth of a 135M model's work (SmolLM2's 49,152 tied rows) and more of Gemma 3's 262k.
        self.compute_logits = True
        # The context window it computes for, which longrope's choice of factors follows (formats/rope.py); None:
        # the model's trained positions, as the runtime's default window.
        self.context_size: Optional[int] = None

    @classmethod
    def from_checkpoint(cls, spec: ModelSpec, checkpoint: Checkpoint, dtype=np.float32,
                        layers: range | None = None) -> "DecoderModel":
        """The model, weights as ``dtype``; with ``layers``, only those layers' blocks (the others None) and
        the embeddings and output head: a range to run with ``stages``."""
        raise NotImplementedError

    def new_cache(self) -> KVCache:
        s = self.spec
        return KVCache(s.n_layers, s.n_kv_heads, s.head_dim, self.dtype)

    def step_fn(self) -> Callable[[np.ndarray], np.ndarray]:
        """A fresh sequence: call it with the next tokens, get the last token's logits."""
        cache = self.new_cache()
        return lambda tokens: self.forward(tokens, cache)[-1]

    def forward(self, tokens: np.ndarray, cache: KVCache) -> np.ndarray:
        """Logits ``[len(tokens), vocab]`` for tokens that follow what ``cache`` holds; extends the cache."""
        stages = self.stages(tokens, cache)
        x = stages.embedded
        for layer in stages.layers:
            x = layer(x)
        cache.advance(len(tokens))
        return stages.finish(x)

    def stages(self, tokens: np.ndarray, cache: KVCache) -> Stages:
        """``forward`` cut at the layer boundaries (the cache not advanced), for callers that run one layer
        over many sequences before the next (``profiling/calibration.py``)."""
        raise NotImplementedError

    def head(self, x: np.ndarray) -> np.ndarray:
        """Logits ``[T, vocab]`` of the final hidden states ``x`` (``output_logits``); ``[T, 0]`` when
        ``compute_logits`` is off."""
        return output_logits(self.spec, x @ self.lm_head.T) if self.compute_logits else x[:, :0]

    def layer(self, i: int, b: Any, x: np.ndarray, cache: KVCache, start: int, norm: Callable,
              rotate: Optional[Rotation] = None) -> np.ndarray:
        """The residual stream after layer ``i``, whose block ``b`` holds ``attn_norm``, ``wq, wk, wv, wo``
        and their biases ``bq .. bo``, ``ffn_norm`` and ``ffn``; ``norm(weights, x)`` is the
        architecture's norm, ``rotate`` its rotary embedding (none for learned positions)."""
        s = self.spec

        def attend(h: np.ndarray) -> np.ndarray:
            qk_norms = None if b.q_norm is None else (partial(norm, b.q_norm), partial(norm, b.k_norm))
            out = self_attention(s, i, linear(h, b.wq, b.bq), linear(h, b.wk, b.bk), linear(h, b.wv, b.bv),
                                 lambda k, v: cache.store(i, k, v), start, rotate, qk_norms)
            return linear(out, b.wo, b.bo)

        def ffn(h: np.ndarray, residual: np.ndarray) -> np.ndarray:
            if s.moe:
                if self.neuron_selector is not None:
                    raise PitoolsError("selecting neurons is per layer; a mixture of experts has no selector yet")
                return mixture_of_experts(s.ffn, b.ffn, s.n_experts_used, h, i, self.ffn_hook, residual)
            thresholds = self.activation_thresholds.layers[i] if self.activation_thresholds is not None else None
            return feed_forward(s.ffn, b.ffn, h, i, self.ffn_hook, self.neuron_selector, residual=residual,
                                thresholds=thresholds)

        post_norms = None if b.post_attn_norm is None else (partial(norm, b.post_attn_norm),
                                                            partial(norm, b.post_ffn_norm))
        return decoder_layer(x, attend, ffn, partial(norm, b.attn_norm), partial(norm, b.ffn_norm), s.pre_norm,
                             post_norms)
