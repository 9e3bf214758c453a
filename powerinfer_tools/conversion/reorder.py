"""Hot-first neuron order: renumber each layer's FFN neurons by profiled firing frequency.

An FFN is a sum over its neurons, so permuting them (rows of gate/up and their
biases, columns of down, rows of the predictor's fc2) leaves the layer's output
unchanged. Putting the most frequently firing neurons first makes the GPU's
"hot" share a contiguous prefix of every matrix.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from powerinfer_tools.formats.constants import PowerInferTensor
from powerinfer_tools.formats.model_spec import FFNUnit
from powerinfer_tools.formats.profile_folder import FiringStats
from powerinfer_tools.formats.architecture import stored_neuron_axis
from powerinfer_tools.models.layers import FFNWeights

# The axis that indexes the neurons in each FFNWeights field ([out_features, in_features] layout).
_FFN_NEURON_AXIS = {"gate": 0, "up": 0, "gate_bias": 0, "up_bias": 0, "down": 1}


def hot_first_permutation(fire_count: np.ndarray) -> np.ndarray:
    """Neuron indices sorted by firing count (or frequency), highest first; ties keep their original order.

    ``new[i] = old[perm[i]]``: apply with ``permute_neurons(tensor, perm, axis)``.
    """
    return np.argsort(-np.asarray(fire_count), kind="stable")


def permute_neurons(tensor: np.ndarray, perm: np.ndarray, axis: int) -> np.ndarray:
    return np.take(tensor, perm, axis=axis)


def permute_ffn(ffn: FFNWeights, perm: np.ndarray) -> FFNWeights:
    """The same FFN with its neurons renumbered by ``perm`` (down's bias is per output, untouched)."""
    changes = {
        name: permute_neurons(getattr(ffn, name), perm, axis)
        for name, axis in _FFN_NEURON_AXIS.items()
        if getattr(ffn, name) is not None
    }
    return replace(ffn, **changes)


def permute_predictor(fc1: np.ndarray, fc2: np.ndarray, perm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A predictor for the permuted layer: its outputs (fc2 rows) follow the neurons; fc1 is unchanged."""
    return fc1, permute_neurons(fc2, perm, stored_neuron_axis(PowerInferTensor.PREDICTOR_FC2))


def profile_permutations(stats: FiringStats, units: list[FFNUnit], d_ff: int) -> dict[FFNUnit, np.ndarray]:
    """One hot-first permutation per FFN (a layer's, or an expert's) of a profile's firing counts."""
    return {unit: hot_first_permutation(stats.unit_counts(unit, d_ff)) for unit in units}
