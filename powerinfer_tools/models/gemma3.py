"""Gemma 3 (text; transformers' ``Gemma3ForCausalLM``, llama.cpp's ``gemma3``).

LLaMA's grouped-query attention and gated FFN with Gemma's changes: the FFN is GeGLU (tanh GELU on the
gate); q and k are RMS-normed per head before RoPE; attention and FFN outputs are normed again before
they join the residual stream; every RMSNorm scales by ``1 + w``; token embeddings are multiplied by
sqrt(d_model); scores are scaled by ``query_pre_attn_scalar``, not the head size; and five layers in
six attend within a sliding window, rotating with their own (local) RoPE base. The layer math is
``models/layers.py``'s, and the reference model LLaMA's (``models.llama.Model``), which its row (``ARCHITECTURE``)
tells of the further norms, the norms' offset, the scaled embeddings and the two rotary bases.
"""

from __future__ import annotations

from gguf import MODEL_TENSOR as T
from gguf import Keys

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.architecture import Architecture, RopePairs, block_rows
from powerinfer_tools.formats.model_spec import FFNKind, ModelSpec, NormKind
from powerinfer_tools.models import llama
from powerinfer_tools.models.base import optional, require, rope_settings, token_id

MODEL_TYPE = "gemma3_text"
ACTIVATION = "gelu_pytorch_tanh"
SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types
CONFIG_KEYS = {**llama.CONFIG_KEYS, "sliding_window_pattern": "layer_types", "rope_local_theta": "rope_local_base_freq"}
_DEFAULT_PATTERN = 6  # transformers' Gemma3TextConfig: every 6th layer global


def spec_from_config(config: dict) -> ModelSpec:
    activation = config.get("hidden_activation", ACTIVATION)
    if activation != ACTIVATION:
        raise PitoolsError(f"gemma3 models with hidden_activation={activation!r} are not supported "
                           f"(supported: {ACTIVATION})")
    for capping in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(capping) is not None:
            raise PitoolsError(f"gemma3 models with {capping} are not supported")
    full, local = _rope_parameters(config)
    return gemma_spec(config, ARCHITECTURE, full, max_positions=optional(config, "max_position_embeddings", 131072),
                      tied_embeddings=optional(config, "tie_word_embeddings", True),
                      sliding_window=optional(config, "sliding_window", 4096),
                      sliding_window_pattern=sliding_window_pattern(config, _DEFAULT_PATTERN),
                      rope_local_theta=rope_settings(local)[0])


def gemma_spec(config: dict, architecture, rope_config: dict, **family_fields) -> ModelSpec:
    """The ``ModelSpec`` of a Gemma config: what Gemma 2 and 3 read alike (GeGLU, RMSNorm, the head width and query
    scale of 256 by default, the rotation ``rope_config`` gives), with each family's own ``family_fields``."""
    head_dim = optional(config, "head_dim", 256)
    theta, scaling = rope_settings(rope_config, head_dim)
    n_heads = require(config, "num_attention_heads", architecture)
    return ModelSpec(
        architecture=architecture,
        n_layers=require(config, "num_hidden_layers", architecture),
        d_model=require(config, "hidden_size", architecture),
        n_heads=n_heads,
        n_kv_heads=optional(config, "num_key_value_heads", n_heads),
        head_dim=head_dim,
        d_ff=require(config, "intermediate_size", architecture),
        vocab_size=require(config, "vocab_size", architecture),
        norm=NormKind.RMS,
        norm_eps=optional(config, "rms_norm_eps", 1e-6),
        ffn=FFNKind.GEGLU,
        rope_theta=theta,
        rope_scaling=scaling,
        query_pre_attn_scalar=optional(config, "query_pre_attn_scalar", 256),
        bos_token_id=token_id(config, "bos_token_id"),
        eos_token_id=token_id(config, "eos_token_id"),
        **family_fields,
    )


def _rope_parameters(config: dict) -> tuple[dict, dict]:
    """(global, local) rope settings, each a config ``rope_settings`` reads: transformers v5 keeps one
    ``rope_parameters`` per layer type; v4 ``rope_theta``/``rope_scaling`` for the global layers and
    ``rope_local_base_freq`` for the sliding ones (which are never scaled)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and FULL in params:
        return {"rope_parameters": params[FULL]}, {"rope_parameters": params.get(SLIDING) or {}}
    return config, {"rope_theta": optional(config, "rope_local_base_freq", 10000.0)}


def sliding_window_pattern(config: dict, default: int) -> int:
    """N where every Nth layer attends globally: from ``layer_types``, which must follow one such pattern (Gemma 2's
    and 3's configs)."""
    layer_types = config.get("layer_types")
    if layer_types is None:
        return optional(config, "sliding_window_pattern", default)
    if not isinstance(layer_types, list) or FULL not in layer_types:
        raise PitoolsError(f"layer_types must list {FULL!r} layers, not {layer_types!r:.60}")
    pattern = layer_types.index(FULL) + 1
    expected = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(len(layer_types))]
    if layer_types != expected:
        raise PitoolsError(f"layer_types must have every {pattern}th layer {FULL!r} and the others {SLIDING!r} "
                           "(the only arrangement supported)")
    return pattern


# What llama.cpp's gemma3 assumes rather than reads (src/llama-model.cpp, LLM_ARCH_GEMMA3): every 6th layer global,
# the sliding ones rotating with base 10000, queries scaled by 1/sqrt(head_dim) except in the 27B model (62 layers),
# whose scale is 1/sqrt(d_model / n_heads). A spec that differs has no GGUF layout (``check_layout``).
GGUF_SLIDING_WINDOW_PATTERN = 6
GGUF_ROPE_LOCAL_THETA = 10000.0
_GEMMA3_27B_LAYERS = 62


def gguf_query_pre_attn_scalar(width_scaled_layers: int, n_layers: int, d_model: int, n_heads: int,
                               head_dim: int) -> float:
    """The ``query_pre_attn_scalar`` llama.cpp's gemma2 and gemma3 assume: d_model / n_heads for the 27B model, which
    they know by its ``width_scaled_layers`` layers, head_dim for the others."""
    return d_model / n_heads if n_layers == width_scaled_layers else head_dim


def stored_query_pre_attn_scalar(get, width_scaled_layers: int) -> float | None:
    """``gguf_query_pre_attn_scalar`` of the shape a file's metadata (read by ``get``) gives; None where that shape
    is not whole numbers above 0 (``ModelSpec`` then says why)."""
    n_layers, d_model = get(Keys.LLM.BLOCK_COUNT), get(Keys.LLM.EMBEDDING_LENGTH)
    n_heads, head_dim = get(Keys.Attention.HEAD_COUNT), get(Keys.Attention.KEY_LENGTH)
    if head_dim is None and isinstance(d_model, int) and isinstance(n_heads, int) and n_heads:
        head_dim = d_model // n_heads
    if all(isinstance(v, int) and v > 0 for v in (n_layers, d_model, n_heads, head_dim)):
        return gguf_query_pre_attn_scalar(width_scaled_layers, n_layers, d_model, n_heads, head_dim)
    return None


def check_assumed(spec: ModelSpec, assumed: dict) -> None:
    """Refuses a model whose fields differ from what its llama.cpp architecture ``assumed`` (field -> value), or
    that has no sliding window (which llama.cpp's gemma2 and gemma3 need)."""
    name = spec.architecture.gguf_name
    for field, value in assumed.items():
        if getattr(spec, field) != value:
            raise PitoolsError(f"a {name} model with {field} {getattr(spec, field)} has no GGUF layout: llama.cpp's "
                               f"{name} assumes {value}")
    if spec.sliding_window is None:
        raise PitoolsError(f"a {name} model without a sliding window has no GGUF layout (llama.cpp's {name} needs one)")


def gguf_fields(get) -> dict:
    """The fields llama.cpp's gemma3 assumes instead of reading keys (above); ``get`` reads the file's metadata."""
    return {"sliding_window_pattern": GGUF_SLIDING_WINDOW_PATTERN, "rope_local_theta": GGUF_ROPE_LOCAL_THETA,
            "query_pre_attn_scalar": stored_query_pre_attn_scalar(get, _GEMMA3_27B_LAYERS)}


def check_layout(spec: ModelSpec) -> None:
    """llama.cpp's gemma3 reads the window but assumes the rest (above): a model that differs is refused."""
    check_assumed(spec, {"sliding_window_pattern": GGUF_SLIDING_WINDOW_PATTERN,
                         "rope_local_theta": GGUF_ROPE_LOCAL_THETA,
                         "query_pre_attn_scalar": gguf_query_pre_attn_scalar(_GEMMA3_27B_LAYERS, spec.n_layers,
                                                                             spec.d_model, spec.n_heads,
                                                                             spec.head_dim)})


_LAYER = "model.layers.{bid}."
ARCHITECTURE = Architecture(
    name="gemma3",
    gguf_name="gemma3",
    model_types=(MODEL_TYPE,),
    hf_classes=("Gemma3ForCausalLM",),
    before=llama.ARCHITECTURE.before,
    block=block_rows(
        _LAYER,
        (T.ATTN_NORM, "input_layernorm"),
        (T.ATTN_Q, "self_attn.q_proj"),
        (T.ATTN_K, "self_attn.k_proj"),
        (T.ATTN_V, "self_attn.v_proj"),
        (T.ATTN_Q_NORM, "self_attn.q_norm"),
        (T.ATTN_K_NORM, "self_attn.k_norm"),
        (T.ATTN_OUT, "self_attn.o_proj"),
        (T.ATTN_POST_NORM, "post_attention_layernorm"),
        (T.FFN_NORM, "pre_feedforward_layernorm"),
        (T.FFN_GATE, "mlp.gate_proj"),
        (T.FFN_UP, "mlp.up_proj"),
        (T.FFN_DOWN, "mlp.down_proj"),
        (T.FFN_POST_NORM, "post_feedforward_layernorm"),
    ),
    after=llama.ARCHITECTURE.after,
    spec_from_config=spec_from_config,
    config_keys=CONFIG_KEYS,
    model=llama.Model,
    ffn_kinds=(FFNKind.GEGLU,),
    dense_ffn=FFNKind.GEGLU,
    sparse_ffn=FFNKind.GEGLU,
    rope_pairs=RopePairs.HALVES,
    attention_biases=(),
    norm_offset=1.0,
    scaled_embeddings=True,
    gguf_fields=gguf_fields,
    check_layout=check_layout,
)
