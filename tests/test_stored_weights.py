"""Thresholds are calibrated, and ``--max-quality-loss`` measured, on the weights the converted file holds
(``conversion.stored_weights``): the reference engine's matrices are the file's, read back, not the source's."""

from __future__ import annotations

import numpy as np
import pytest

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.conversion.convert import convert
from powerinfer_tools.conversion.sparsify import SparsifySettings
from powerinfer_tools.conversion.stored_weights import StoredWeights, rounded
from powerinfer_tools.formats.model_file import open_model_file
from powerinfer_tools.formats.quantization import OUTTYPES
from powerinfer_tools.formats.weight_types import Q4_0
from powerinfer_tools.models import spec_from_config

FFN = {"gate": ("mlp.gate_proj", "ffn_gate", False), "up": ("mlp.up_proj", "ffn_up", False),
       "down": ("mlp.down_proj", "ffn_down_t", True)}


@pytest.fixture(scope="module")
def q4_0_file(silu_model, tmp_path_factory):
    """The tiny SiLU model converted to a thresholded q4_0 file, neurons in their own order."""
    out = tmp_path_factory.mktemp("stored") / "model.powerinfer.gguf"
    return convert(str(silu_model), out, "q4_0", progress=False,
                   sparsify=SparsifySettings(tokens=1024, target_sparsity=0.3, reorder=False))[0]


def _stored(silu_model, outtype: str) -> StoredWeights:
    checkpoint = Checkpoint(silu_model)
    spec = spec_from_config(checkpoint.config, checkpoint.config_path)
    return StoredWeights(checkpoint, spec, OUTTYPES[outtype], powerinfer=True)


@pytest.mark.parametrize("matrix", list(FFN))
def test_the_engine_reads_the_matrices_the_file_holds(silu_model, q4_0_file, matrix):
    """Each FFN matrix as the q4_0 file stores it (ffn_down_t by neuron), bit for bit; the source's differ."""
    hf, target, transposed = FFN[matrix]
    stored, source = _stored(silu_model, "q4_0"), Checkpoint(silu_model)
    file = open_model_file(q4_0_file)
    for layer in range(2):
        name = f"model.layers.{layer}.{hf}.weight"
        ours = stored.tensor(name)
        held = file[f"blk.{layer}.{target}.weight"].dequantize()
        np.testing.assert_array_equal(ours.T if transposed else ours, held)
        assert np.abs(ours - source.tensor(name)).max() > 1e-4


def test_down_is_rounded_by_neuron_not_across_neurons(silu_model):
    """The PowerInfer layout quantizes each neuron's down weights together: not what rounding the checkpoint's
    rows (each across 32 neurons) gives."""
    stored, source = _stored(silu_model, "q4_0"), Checkpoint(silu_model)
    name = "model.layers.0.mlp.down_proj.weight"
    down = source.tensor(name)
    np.testing.assert_array_equal(stored.tensor(name), rounded(down.T, Q4_0).T)
    assert np.abs(stored.tensor(name) - rounded(down, Q4_0)).max() > 1e-4


def test_an_f32_file_holds_the_source(silu_model):
    stored, source = _stored(silu_model, "f32"), Checkpoint(silu_model)
    for name in source:
        np.testing.assert_array_equal(stored.tensor(name), source.tensor(name))
    assert set(stored) == set(source)
