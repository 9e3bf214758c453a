"""What every architecture module provides, and the config-reading helpers they share."""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from ..checkpoint import Checkpoint
from ..errors import PitoolsError
from .layers import FFNHook, KVCache, NeuronSelector
from .spec import ModelSpec


def require(config: dict, key: str, architecture: str) -> Any:
    """A config field the model cannot be built without."""
    if key not in config or config[key] is None:
        raise PitoolsError(f"config.json of this {architecture} model lacks the field {key!r}")
    return config[key]


def rope_settings(config: dict) -> tuple[float, float]:
    """(theta, linear scaling factor) from either transformers' v4 or v5 config layout."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), 1.0
    if rope_type == "linear":
        return float(theta), float(params["factor"])
    raise PitoolsError(f"config.json: rope scaling type {rope_type!r} is not supported (supported: default, linear)")


class DecoderModel:
    """A decoder-only language model evaluated in NumPy, one sequence at a time.

    ``ffn_hook`` (if set) sees every FFN's input and activations; ``neuron_selector``
    (if set) restricts which neurons each FFN computes. Both exist so profiling and
    sparse evaluation can use the reference model unchanged.
    """

    spec: ModelSpec
    dtype: np.dtype

    def __init__(self) -> None:
        self.ffn_hook: Optional[FFNHook] = None
        self.neuron_selector: Optional[NeuronSelector] = None

    @classmethod
    def from_checkpoint(cls, spec: ModelSpec, checkpoint: Checkpoint, dtype=np.float32) -> "DecoderModel":
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
        raise NotImplementedError
