"""Sparse FFN execution over neuron partitions.

A layer's neurons are split into partitions, one per backend: the hot ones the
split file places on the GPU, the cold ones on the CPU (without a split, one
CPU partition holds them all). For a block of tokens each partition computes
only its *active* neurons: rows of gate and up give their activations, rows of
the transposed down projection (``ffn_down_t``, one row per neuron) are summed
with those activations as weights. The partial outputs add up to the FFN output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from powerinfer_tools.formats.constants import PowerInferTensor, block_part
from powerinfer_tools.formats.model_spec import FFNKind
from powerinfer_tools.formats.predictor_rule import chooses, hidden_layer
from powerinfer_tools.kernels.interleaved import InterleavedQ4
from powerinfer_tools.kernels.quant import QuantMatrix
from powerinfer_tools.models.layers import activate
from powerinfer_tools.runtime.neuron_cache import NeuronCache


@dataclass
class Predictor:
    """PowerInfer's per-layer MLP: neuron ``i`` is computed when ``(fc2 relu(fc1 x))_i >= threshold``, as PowerInfer does.

    ``fc1`` and ``fc2`` stay in their stored type (q4_0, q8_0, f16 or f32) and are multiplied like the
    weights, through ``backend.matmul``: on the CPU ggml's ``vec_dot`` with x (then the hidden vector)
    encoded as llama.cpp encodes it, q8_0 for quantized rows; on a device a chunk of rows dequantized at
    a time. The rule (relu, the threshold) is ``formats.predictor_rule``'s; its ``predict`` on the dequantized
    weights is the float32 reference."""

    backend: object
    fc1: QuantMatrix  # [hidden, d_model]
    fc2: QuantMatrix  # [d_ff, hidden]
    threshold: float = 0.0

    def scores(self, x):
        """``fc2 · relu(fc1 · x)``, float32 ``[T, d_ff]``, on the predictor's backend."""
        return self.backend.matmul(self.fc2, hidden_layer(self.backend.matmul(self.fc1, x)))

    def __call__(self, x):
        return chooses(self.scores(x), self.threshold)

    @property
    def nbytes(self) -> int:
        """Bytes read per token: the stored size."""
        return self.fc1.nbytes + self.fc2.nbytes


@dataclass
class FFNPartition:
    """The neurons of one layer that one backend computes, with their weight rows on that backend.

    ``row_of[n]`` is the row of global neuron ``n`` in this partition's matrices
    (-1 when the neuron is elsewhere): the CPU partition indexes the memory-mapped
    file directly, a device partition its uploaded copy of just its rows.
    """

    backend: object
    neurons: np.ndarray  # sorted global neuron ids
    row_of: np.ndarray  # [d_ff] int64
    up: QuantMatrix | InterleavedQ4  # interleaved where computed whole (a dense file, loader.WHOLE_UP_SHARE)
    down_t: Optional[QuantMatrix]  # [d_ff, d_model], neuron-major: what sparse execution reads
    down: Optional[QuantMatrix] = None  # [d_model, d_ff] of a dense file: all neurons at once only
    gate: Optional[QuantMatrix | InterleavedQ4] = None  # likewise (and a CATS gate)
    gate_bias: Optional[np.ndarray] = None
    up_bias: Optional[np.ndarray] = None
    # Under a RAM budget: the neuron cache whose rows these matrices are; ``row_of`` is its map and
    # changes as neurons come and go (``neuron_cache.compute_cached`` makes rows resident first).
    cache: Optional[NeuronCache] = None

    def activations(self, kind: FFNKind, x, neurons: np.ndarray):
        """Activated values ``[T, len(neurons)]`` of the given global neurons (all in this partition)."""
        return self._activations(kind, x, self.backend.xp.asarray(self.row_of[neurons]))

    def pre_activations(self, x, rows, up: bool = True, gate: bool = True):
        """``(gate, up)`` products (biases added) ``[T, len(rows)]`` of the neurons in this partition's
        ``rows`` (on its backend): gate None for an ungated FFN, either None when not asked for."""
        gate_pre, up_pre = None, None
        if gate and self.gate is not None:
            gate_pre = self.backend.matmul(self.gate, x, rows)
            if self.gate_bias is not None:
                gate_pre += self.gate_bias[rows]
        if up:
            up_pre = self.backend.matmul(self.up, x, rows)
            if self.up_bias is not None:
                up_pre += self.up_bias[rows]
        return gate_pre, up_pre

    def _activations(self, kind: FFNKind, x, rows):
        return activate(kind, *self.pre_activations(x, rows))

    def compute(self, kind: FFNKind, x, active: np.ndarray, mask=None):
        """Partial FFN output ``[T, d_model]`` of the ``active`` global neurons (all in this partition).

        ``mask [T, len(active)]`` zeroes the neurons a token did not select; without
        it every active neuron counts for every token.
        """
        rows = self.row_of[active]
        device_rows = self.backend.xp.asarray(rows)  # one upload for the products of gate, up and down
        activated = self._activations(kind, x, device_rows)
        if mask is not None:
            activated = activated * mask
        if self.down_t is None:
            if len(rows) != self.down.cols:
                raise RuntimeError(
                    f"this model file has no {block_part(PowerInferTensor.FFN_DOWN_T)}: only dense mode can run it"
                )
            return self.backend.matmul(self.down, activated)
        return self.backend.row_sum(self.down_t, activated, device_rows)
