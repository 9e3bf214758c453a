"""One typed description of a model, whatever checkpoint format it came from."""

from __future__ import annotations

import contextlib
import enum
import math
import numbers
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Mapping

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.rope import RopeKind, RopeScaling

if TYPE_CHECKING:
    from powerinfer_tools.formats.architecture import Architecture

# Upper bounds on a model's dimensions. Released models stay far below them (LLaMA-3.1-405B:
# width 16384, FFN 53248, 126 layers, 128256 tokens, 131072 positions); a larger value is a
# corrupt or mistyped header, refused before anything is sized by it (the runtime allocates
# attention scratch by the context length, the engine tables by the vocabulary).
MAX_WIDTH = 2**20  # d_model, d_ff, head_dim, embed_dim, and heads x head_dim
MAX_LAYERS = 1024
MAX_VOCAB = 2**24
MAX_POSITIONS = 2**24
MAX_EXPERTS = 1024  # DeepSeek-V3 routes among 256 experts per layer, Mixtral among 8

# The positive values float32 holds: the real fields (norm_eps, rope_theta, the rope scaling's) are written
# to a model file as float32, where a larger one would not fit and a smaller one would become 0.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINIEST = 2.0**-149  # the smallest subnormal

# OPT reserves the first two rows of its position table (ModelSpec.position_offset): the reference
# engine and the GGUF reader both need it.
OPT_POSITION_OFFSET = 2


class FFNKind(str, enum.Enum):
    """How an FFN turns its input into activated neurons.

    Each kind defines which neurons "fire" for a token: those whose activated
    value is non-zero. Only the ReLU family is sparse.
    """

    RELU = "relu"  # OPT: fc2(relu(fc1 x + b1)) + b2
    REGLU = "reglu"  # ReluLLaMA, ProSparse: down(relu(gate x) * up x)
    DRELU = "drelu"  # TurboSparse, Bamboo: down(relu(gate x) * relu(up x))
    SWIGLU = "swiglu"  # plain LLaMA/Mistral: down(silu(gate x) * up x), dense
    GEGLU = "geglu"  # Gemma 2 and 3: down(gelu_tanh(gate x) * up x), dense

    @property
    def gated(self) -> bool:
        return self is not FFNKind.RELU

    @property
    def sparse(self) -> bool:
        return self not in (FFNKind.SWIGLU, FFNKind.GEGLU)

    @property
    def activation(self) -> str:
        """The activation of its first product, as people name it: ReLU, SiLU, GELU."""
        return {FFNKind.SWIGLU: "SiLU", FFNKind.GEGLU: "GELU"}.get(self, "ReLU")

    @property
    def relu_gated(self) -> bool:
        """relu of the gate product: a neuron fires exactly where its gate product is positive."""
        return self in (FFNKind.REGLU, FFNKind.DRELU)


@dataclass(frozen=True)
class FFNUnit:
    """One FFN of a model: a layer's, or one expert's of a layer's mixture. Profiles, predictors and
    neuron orders are per unit, in ``ModelSpec.ffn_units`` order."""

    layer: int
    expert: int | None = None

    def __str__(self) -> str:
        return f"layer {self.layer}" + ("" if self.expert is None else f" expert {self.expert}")


def ffn_units(n_layers: int, n_experts: int) -> list[FFNUnit]:
    """Every FFN of a model, layer by layer and, in a mixture (``n_experts`` > 0), expert by expert."""
    if not n_experts:
        return [FFNUnit(layer) for layer in range(n_layers)]
    return [FFNUnit(layer, e) for layer in range(n_layers) for e in range(n_experts)]


class NormKind(str, enum.Enum):
    RMS = "rms"
    LAYER = "layer"


@dataclass(frozen=True)
class ModelSpec:
    """Everything the engine, the converter and the solver need to know about a model's shape."""

    architecture: Architecture  # its family's row (formats/architecture.py): models/<family>.py's ARCHITECTURE
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int | None  # None: d_model / n_heads, which must then divide evenly
    d_ff: int
    vocab_size: int
    max_positions: int
    norm: NormKind
    norm_eps: float
    ffn: FFNKind
    tied_embeddings: bool
    # Rotary position embeddings (LLaMA, Mistral); None for learned positions (OPT).
    rope_theta: float | None = None
    rope_scaling: RopeScaling = RopeScaling()  # formats/rope.py
    sliding_window: int | None = None  # Mistral: a query sees at most this many keys
    # Gemma 2 and 3: only some layers slide. With a pattern N > 0, every Nth layer (the last of each N) attends
    # to the whole context with rope_theta, the others within sliding_window (with rope_local_theta where set:
    # Gemma 3's).
    sliding_window_pattern: int = 0
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None  # scores are divided by its square root; None: head_dim's
    # Gemma 2: attention scores (scaled, before the mask) and the final logits are soft-capped,
    # cap * tanh(x / cap) (``formats/soft_cap.py``); None: not capped.
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    attention_bias: bool = False
    ffn_bias: bool = False
    # OPT only.
    pre_norm: bool = True  # False: OPT-350m style post-LayerNorm blocks
    final_norm: bool = True
    embed_dim: int | None = None  # word_embed_proj_dim when it differs from d_model
    position_offset: int = 0  # OPT's learned positions start at index 2
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Mixture of experts (Mixtral): each layer's FFN is n_experts FFNs of width d_ff, of which a router
    # picks n_experts_used per token. 0: one dense FFN per layer.
    n_experts: int = 0
    n_experts_used: int = 0

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def n_kv_groups(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    @property
    def ffn_units(self) -> list[FFNUnit]:
        return ffn_units(self.n_layers, self.n_experts)

    @property
    def token_embed_dim(self) -> int:
        return self.embed_dim or self.d_model

    def slides(self, layer: int) -> bool:
        """Whether ``layer`` attends within ``sliding_window`` (every layer of a model with a window and
        no pattern, as Mistral's)."""
        if self.sliding_window is None:
            return False
        return not self.sliding_window_pattern or (layer + 1) % self.sliding_window_pattern != 0

    def layer_window(self, layer: int) -> int | None:
        """How many keys a query of ``layer`` sees at most; None: all before it."""
        return self.sliding_window if self.slides(layer) else None

    def layer_rope(self, layer: int) -> tuple[float | None, RopeScaling]:
        """(rope theta, scaling) of ``layer``: a sliding layer of a model with a local theta (Gemma 3) rotates
        with that, unscaled, as transformers' and llama.cpp's Gemma 3 do."""
        if self.rope_local_theta is not None and self.slides(layer):
            return self.rope_local_theta, RopeScaling()
        return self.rope_theta, self.rope_scaling

    @property
    def attention_scale(self) -> float:
        """What attention scores are multiplied by: 1/sqrt(head_dim) unless the model says otherwise."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5


# --- validation: every constructor (config.json, GGUF metadata) passes through ModelSpec.__post_init__ --------


class InvalidSpec(PitoolsError):
    """A ModelSpec field of the wrong type or out of range.

    ``describe`` writes the message given a function that names a field, so the boundary
    that read the values (``spec_errors_named``) can say which file and which key of it.
    """

    def __init__(self, describe: Callable[[Callable[[str], str]], str]):
        super().__init__(describe(lambda field: field))
        self.describe = describe


@contextlib.contextmanager
def spec_errors_named(source: str | os.PathLike, keys: Mapping[str, str]) -> Iterator[None]:
    """Prefix every PitoolsError raised inside with ``source``; name InvalidSpec's fields by ``keys``."""
    try:
        yield
    except InvalidSpec as exc:
        raise PitoolsError(f"{source}: {exc.describe(lambda field: keys.get(field, field))}") from None
    except PitoolsError as exc:
        raise PitoolsError(f"{source}: {exc}") from None


def _shown(value) -> str:
    """A value for a message: its repr, cut short (a file may hold a whole array where a number is due)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _integer(spec: ModelSpec, field: str, low: int, high: int, optional: bool = False) -> None:
    value = getattr(spec, field)
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidSpec(lambda name: f"{name(field)} must be an integer, not {_shown(value)}")
    if value < low:
        raise InvalidSpec(lambda name: f"{name(field)} is {value}; it must be at least {low}")
    if value > high:
        raise InvalidSpec(lambda name: f"{name(field)} is {value}; it must be at most {high}")
    object.__setattr__(spec, field, int(value))  # a NumPy integer from a file becomes a plain int


def _as_float(value) -> float:
    """``value`` as a float: NaN when it is no number (a bool included), inf beyond float's range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return math.nan
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _positive_real(spec: ModelSpec, field: str, optional: bool = False) -> None:
    value = getattr(spec, field)
    if value is None and optional:
        return
    object.__setattr__(spec, field, _float32(value, field))


def _float32(value, field: str) -> float:
    """``value``, of the field ``field``, as a float above 0 that float32 holds."""
    number = _as_float(value)
    if not math.isfinite(number) or number <= 0:
        raise InvalidSpec(lambda name: f"{name(field)} must be a finite number above 0, not {_shown(value)}")
    if not FLOAT32_TINIEST <= number <= FLOAT32_MAX:
        raise InvalidSpec(lambda name: f"{name(field)} is {number:g}; it must fit float32 (from {FLOAT32_TINIEST:.4g} "
                                       f"to {FLOAT32_MAX:.4g}), as a model file stores it")
    return number


def _flag(spec: ModelSpec, field: str) -> None:
    value = getattr(spec, field)
    if not isinstance(value, bool):
        raise InvalidSpec(lambda name: f"{name(field)} must be true or false, not {_shown(value)}")


def _token_id(spec: ModelSpec, field: str) -> None:
    _integer(spec, field, 0, MAX_VOCAB, optional=True)
    value, vocab = getattr(spec, field), spec.vocab_size
    if value is not None and value >= vocab:
        raise InvalidSpec(lambda name: f"{name(field)} is {value}; it must be below {name('vocab_size')} ({vocab})")


def _divides(spec: ModelSpec, whole: str, part: str) -> None:
    w, p = getattr(spec, whole), getattr(spec, part)
    if w % p:
        raise InvalidSpec(lambda name: f"{name(whole)} ({w}) is not a multiple of {name(part)} ({p})")


def _check_ffn(spec: ModelSpec) -> None:
    if spec.ffn not in spec.architecture.ffn_kinds:
        kinds = ", ".join(kind.value for kind in spec.architecture.ffn_kinds)
        raise InvalidSpec(lambda name: f"{name('ffn')} is {spec.ffn.value}, which {spec.architecture} models do not have "
                                       f"(they have: {kinds})")


def _check_rope_scaling(spec: ModelSpec) -> None:
    """The scaling's numbers, of the kinds the family has (config.json's rope_type, GGUF's rope.scaling.type)."""
    scaling = spec.rope_scaling
    if scaling.kind not in spec.architecture.rope_kinds:
        kinds = ", ".join(kind.value for kind in spec.architecture.rope_kinds)
        raise InvalidSpec(lambda name: f"{name('rope_scaling')} type {scaling.kind.value!r} is not supported for "
                                       f"{spec.architecture} models (supported: {kinds})")
    _float32(scaling.factor, "rope_scaling_factor")
    if scaling.kind is RopeKind.LLAMA3:
        _check_pair_factors(spec, "rope_scaling", scaling.frequency_factors)
    if scaling.kind is RopeKind.LONGROPE:
        _check_pair_factors(spec, "rope_short_factors", scaling.short_factors)
        _check_pair_factors(spec, "rope_long_factors", scaling.long_factors)
        _float32(scaling.attention_factor, "rope_attention_factor")
    if scaling.kind in (RopeKind.YARN, RopeKind.LONGROPE):
        context = scaling.original_context
        if isinstance(context, bool) or not isinstance(context, numbers.Integral) or not 1 <= context <= MAX_POSITIONS:
            raise InvalidSpec(lambda name: f"{name('rope_scaling')} original context must be an integer from 1 to "
                                           f"{MAX_POSITIONS}, not {_shown(context)}")


def _check_pair_factors(spec: ModelSpec, field: str, factors) -> None:
    """A scaling's divisors per rotation pair (llama3's, each of longrope's lists, named ``field`` in messages):
    head_dim / 2 positive numbers."""
    if not isinstance(factors, (tuple, list)) or len(factors) != spec.head_dim // 2 or not all(
            math.isfinite(_as_float(f)) and _as_float(f) > 0 for f in factors):
        raise InvalidSpec(lambda name: f"{name(field)} needs {spec.head_dim // 2} positive factors (one per rotation "
                                       f"pair), not {_shown(factors)}")


def _validate(spec: ModelSpec) -> None:
    """Types and ranges of every field a file supplies; derives head_dim when it is None."""
    for field, high in (("n_layers", MAX_LAYERS), ("d_model", MAX_WIDTH), ("n_heads", MAX_WIDTH),
                        ("n_kv_heads", MAX_WIDTH), ("d_ff", MAX_WIDTH), ("vocab_size", MAX_VOCAB),
                        ("max_positions", MAX_POSITIONS)):
        _integer(spec, field, 1, high)
    _divides(spec, "n_heads", "n_kv_heads")
    if spec.head_dim is None:
        _divides(spec, "d_model", "n_heads")
        object.__setattr__(spec, "head_dim", spec.d_model // spec.n_heads)
    _integer(spec, "head_dim", 1, MAX_WIDTH // spec.n_heads)  # the query width stays within MAX_WIDTH
    _integer(spec, "embed_dim", 1, MAX_WIDTH, optional=True)
    _integer(spec, "sliding_window", 1, MAX_POSITIONS, optional=True)
    for field in ("bos_token_id", "eos_token_id"):
        _token_id(spec, field)
    _positive_real(spec, "norm_eps")
    _positive_real(spec, "rope_theta", optional=True)
    _positive_real(spec, "rope_local_theta", optional=True)
    _positive_real(spec, "query_pre_attn_scalar", optional=True)
    _positive_real(spec, "attn_logit_softcapping", optional=True)
    _positive_real(spec, "final_logit_softcapping", optional=True)
    _integer(spec, "sliding_window_pattern", 0, MAX_LAYERS)
    _check_rope_scaling(spec)
    _check_ffn(spec)
    for field in ("tied_embeddings", "attention_bias", "ffn_bias", "pre_norm", "final_norm"):
        _flag(spec, field)
    _integer(spec, "n_experts", 0, MAX_EXPERTS)
    # A router picks at least one of the experts there are; a dense model picks none.
    _integer(spec, "n_experts_used", min(spec.n_experts, 1), spec.n_experts)
