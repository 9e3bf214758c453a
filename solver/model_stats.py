"""The placement problem's per-layer numbers, read from a PowerInfer model file.

Sizes are those of the tensors as stored (their quantization included); firing
frequencies are the ones ``pitools convert`` recorded from its profile, in the
file's neuron order (``pitools.blk.N.neuron_frequency``). A mixture of experts places each
layer's experts' neurons as one layer's, side by side (expert-major, as its split masks hold
them), a neuron's hotness its expert's routing frequency times its own firing frequency. A SiLU model
thresholded by CATS reads every neuron's gate row every token (the choice is made from them), so its
neurons' frequencies become their expected share of bytes read: (gate + frequency x (up + down)) / all.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import MODEL_TENSOR as T
from powerinfer_tools.formats.activation_thresholds import read_thresholds
from powerinfer_tools.formats.constants import (PowerInferTensor, TensorKind, expert_frequency_key,
                                                neuron_frequency_key, tensor_name)
from powerinfer_tools.formats.model_check import check_model_tensors, neuron_frequencies, routing_frequencies, sparse_layout
from powerinfer_tools.formats.model_file import ModelFile, open_model_file
from powerinfer_tools.models import spec_from_model_file
from powerinfer_tools.solver.problem import kv_cache_bytes_per_token

from powerinfer_tools.errors import PitoolsError

# Tensors of a layer's dense block: attention and both norms (read every token, wherever the block runs).
_DENSE_PARTS = (T.ATTN_NORM, T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.ATTN_OUT, T.FFN_NORM, T.FFN_GATE_INP)
_NEURON_PARTS = (T.FFN_GATE, T.FFN_UP, PowerInferTensor.FFN_DOWN_T, PowerInferTensor.FFN_BUNDLE)  # either layout
_PREDICTOR_PARTS = (PowerInferTensor.PREDICTOR_FC1, PowerInferTensor.PREDICTOR_FC2)


def _bytes(model: ModelFile, layer: int | None, parts: tuple[TensorKind, ...], expert: int | None = None) -> int:
    """Bytes of the weights and biases of ``parts`` (those present) of a layer (or one of its experts), or
    global ones."""
    names = (tensor_name(part, layer, kind, expert) for part in parts for kind in ("weight", "bias"))
    return sum(model[name].nbytes for name in names if name in model)


def _unit_frequencies(path, model: ModelFile, spec, layer: int) -> np.ndarray:
    """How often each of a layer's neurons is computed per token: its firing probability; in a mixture,
    the experts' neurons side by side, each expert's firing probability (over the tokens routed to it)
    times its routing frequency, the share of tokens routed to it."""
    if not spec.moe:
        return _recorded(path, neuron_frequencies(model, spec, layer))
    routing = routing_frequencies(model, spec, layer)
    if routing is None:
        raise PitoolsError(f"{path}: no routing frequencies ({expert_frequency_key(layer)}); convert the model "
                           "with profiling (the default of pitools convert)")
    return np.concatenate([float(share) * _recorded(path, neuron_frequencies(model, spec, layer, e))
                           for e, share in enumerate(routing)])


def _recorded(path, freq: np.ndarray | None) -> np.ndarray:
    if freq is None:
        raise PitoolsError(
            f"{path}: no neuron firing frequencies ({neuron_frequency_key('N')}); convert the model with "
            "profiling (the default of pitools convert), or pass --stats FILE.npz"
        )
    return freq


def _with_every_gate_read(model: ModelFile, layer: int, freq: np.ndarray) -> np.ndarray:
    gate, all_parts = _bytes(model, layer, (T.FFN_GATE,)), _bytes(model, layer, _NEURON_PARTS)
    return (gate + freq * (all_parts - gate)) / all_parts


def read_model_stats(path: str | Path) -> dict:
    """The arrays ``problem_from_stats`` takes (its ``STATS_KEYS``), for a PowerInfer model file."""
    model = open_model_file(path)
    spec = spec_from_model_file(model)
    if not sparse_layout(model):
        raise PitoolsError(f"{path}: a dense model file; neuron placement needs a PowerInfer file (pitools convert)")
    check_model_tensors(model, spec)
    freqs = [_unit_frequencies(path, model, spec, layer) for layer in range(spec.n_layers)]
    thresholds = read_thresholds(model.get, spec.n_layers, str(path))
    if thresholds is not None and "cats" in thresholds.rule.thresholds:
        freqs = [_with_every_gate_read(model, layer, f) for layer, f in enumerate(freqs)]
    # Tied: the logits read the token embedding matrix.
    logits = T.OUTPUT if tensor_name(T.OUTPUT) in model else T.TOKEN_EMBD
    layers, experts = range(spec.n_layers), range(spec.n_experts) if spec.moe else [None]
    return {
        "freqs": freqs,
        "neuron_bytes": [_bytes(model, i, _NEURON_PARTS, next(iter(experts))) // spec.d_ff for i in layers],
        "dense_bytes": [_bytes(model, i, _DENSE_PARTS) for i in layers],
        # A mixture's predictors all count, as memory; a token reads only its routed experts' (an overestimate
        # of the CPU's reads by n_experts / n_experts_used, small beside the FFN rows).
        "predictor_bytes": [sum(_bytes(model, i, _PREDICTOR_PARTS, e) for e in experts) for i in layers],
        "kv_bytes_per_token": kv_cache_bytes_per_token(spec.n_kv_heads * spec.head_dim),
        "head_bytes": _bytes(model, None, (T.OUTPUT_NORM,)) + model[tensor_name(logits)].nbytes,
        "hidden_bytes": spec.d_model * 4,
    }


def read_embedding_stats(path: str | Path) -> dict:
    """The RAM tier's inputs beyond ``read_model_stats`` (``tiers.EMBEDDING_STATS_KEYS``): the token embedding
    matrix's bytes, and whether the file has no output matrix, its head reading the embeddings (tied)."""
    model = open_model_file(path)
    if spec_from_model_file(model).moe:
        raise PitoolsError(f"{path}: a RAM tier (--ram) is not supported yet for a mixture of experts")
    return {
        "embedding_bytes": model[tensor_name(T.TOKEN_EMBD)].nbytes,
        "embedding_in_head": tensor_name(T.OUTPUT) not in model,
    }
