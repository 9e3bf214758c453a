"""One typed description of a model, whatever checkpoint format it came from."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FFNKind(str, enum.Enum):
    """How an FFN turns its input into activated neurons.

    Each kind defines which neurons "fire" for a token: those whose activated
    value is non-zero. Only the ReLU family is sparse.
    """

    RELU = "relu"  # OPT: fc2(relu(fc1 x + b1)) + b2
    REGLU = "reglu"  # ReluLLaMA, ProSparse: down(relu(gate x) * up x)
    DRELU = "drelu"  # TurboSparse, Bamboo: down(relu(gate x) * relu(up x))
    SWIGLU = "swiglu"  # plain LLaMA/Mistral: down(silu(gate x) * up x), dense

    @property
    def gated(self) -> bool:
        return self is not FFNKind.RELU

    @property
    def sparse(self) -> bool:
        return self is not FFNKind.SWIGLU


class NormKind(str, enum.Enum):
    RMS = "rms"
    LAYER = "layer"


@dataclass(frozen=True)
class ModelSpec:
    """Everything the engine, the converter and the solver need to know about a model's shape."""

    architecture: str  # our module name: "llama", "mistral", "opt"
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    max_positions: int
    norm: NormKind
    norm_eps: float
    ffn: FFNKind
    tied_embeddings: bool
    # Rotary position embeddings (LLaMA, Mistral); None for learned positions (OPT).
    rope_theta: float | None = None
    rope_scaling_factor: float = 1.0  # "linear" scaling: positions are divided by it
    sliding_window: int | None = None  # Mistral: a query sees at most this many keys
    attention_bias: bool = False
    ffn_bias: bool = False
    # OPT only.
    pre_norm: bool = True  # False: OPT-350m style post-LayerNorm blocks
    final_norm: bool = True
    embed_dim: int | None = None  # word_embed_proj_dim when it differs from d_model
    position_offset: int = 0  # OPT's learned positions start at index 2
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @property
    def n_kv_groups(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def token_embed_dim(self) -> int:
        return self.embed_dim or self.d_model
