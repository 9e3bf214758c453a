"""What every architecture module provides, and the config-reading helpers they share."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import numpy as np
from gguf import MODEL_TENSOR as T

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.activation_thresholds import ActivationThresholds
from powerinfer_tools.formats.model_spec import ModelSpec
from powerinfer_tools.formats.tensor_table import ArchitectureTable
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


def rope_settings(config: dict) -> tuple[Any, Any]:
    """(theta, linear scaling factor) from either transformers' v4 or v5 config layout."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise PitoolsError(f"rope_scaling must be an object, not {params!r}")
    theta = optional(params, "rope_theta", optional(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, 1.0
    if rope_type == "linear":
        if params.get("factor") is None:
            raise PitoolsError("linear rope scaling lacks its 'factor'")
        return theta, params["factor"]
    raise PitoolsError(f"rope scaling type {rope_type!r} is not supported (supported: default, linear)")


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
    # Gemma 3's further norms: of q and k per head (``[head_dim]``), after attention and after the FFN.
    q_norm: Any = None
    k_norm: Any = None
    post_attn_norm: Any = None
    post_ffn_norm: Any = None


# Block fields -> the tensors of the further norms an architecture's table may have.
EXTRA_NORMS = {"q_norm": T.ATTN_Q_NORM, "k_norm": T.ATTN_K_NORM, "post_attn_norm": T.ATTN_POST_NORM,
               "post_ffn_norm": T.FFN_POST_NORM}


def load_block(w: CheckpointWeights, table: ArchitectureTable, spec: ModelSpec, layer: int,
               norm: Callable[[T, int], Any]) -> Block:
    """Layer ``layer`` of a checkpoint whose tensors ``table`` names; ``norm(tensor, layer)`` reads a norm."""
    d, d_ff = spec.d_model, spec.d_ff
    q_rows, kv_rows = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim

    def projection(tensor: T, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray | None]:
        return w.get(table.hf_name(tensor, layer), rows, cols), w.maybe(table.hf_name(tensor, layer, "bias"), rows)

    (wq, bq), (wk, bk) = projection(T.ATTN_Q, q_rows, d), projection(T.ATTN_K, kv_rows, d)
    (wv, bv), (wo, bo) = projection(T.ATTN_V, kv_rows, d), projection(T.ATTN_OUT, d, q_rows)
    if spec.moe:
        ffn = MoEWeights(w.get(table.hf_name(T.FFN_GATE_INP, layer), spec.n_experts, d),
                         [_expert(w, table, spec, layer, e) for e in range(spec.n_experts)])
    else:
        gate, gate_bias = projection(T.FFN_GATE, d_ff, d) if spec.ffn.gated else (None, None)
        (up, up_bias), (down, down_bias) = projection(T.FFN_UP, d_ff, d), projection(T.FFN_DOWN, d, d_ff)
        ffn = FFNWeights(up, down, gate=gate, gate_bias=gate_bias, up_bias=up_bias, down_bias=down_bias)
    extra_norms = {field: norm(tensor, layer) for field, tensor in EXTRA_NORMS.items() if table.has(tensor)}
    return Block(attn_norm=norm(T.ATTN_NORM, layer), wq=wq, wk=wk, wv=wv, wo=wo, bq=bq, bk=bk, bv=bv, bo=bo,
                 ffn_norm=norm(T.FFN_NORM, layer), ffn=ffn, **extra_norms)


def _expert(w: CheckpointWeights, table: ArchitectureTable, spec: ModelSpec, layer: int, expert: int) -> FFNWeights:
    """One expert's gated FFN (experts have no biases)."""
    d, d_ff = spec.d_model, spec.d_ff

    def weight(tensor: T, rows: int, cols: int) -> np.ndarray:
        return w.get(table.hf_name(tensor, layer, expert=expert), rows, cols)

    return FFNWeights(weight(T.FFN_UP_EXP, d_ff, d), weight(T.FFN_DOWN_EXP, d, d_ff), gate=weight(T.FFN_GATE_EXP, d_ff, d))


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
        """Logits ``[T, vocab]`` of the final hidden states ``x``; ``[T, 0]`` when ``compute_logits`` is off."""
        return x @ self.lm_head.T if self.compute_logits else x[:, :0]

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
