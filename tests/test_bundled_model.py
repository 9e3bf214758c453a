"""The bundled model against its model card: our reference engine recomputes the sparsity figures."""

from __future__ import annotations

import json

import numpy as np

from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.checkpoints.tokenizer import CheckpointTokenizer
from powerinfer_tools.models import load_model
from powerinfer_tools.profiling.corpus import read_tokens, resolve_source

SLICE_TOKENS = 4096  # a small held-out slice: the card's figures are over 86k tokens


def test_firing_fraction_per_layer_matches_the_card():
    card = json.loads((BUNDLED_MODEL / "metrics.json").read_text())["sparsity"]
    model = load_model(Checkpoint(BUNDLED_MODEL))
    spec = model.spec
    tokens = read_tokens(resolve_source((), None, BUNDLED_MODEL),
                         CheckpointTokenizer(BUNDLED_MODEL, spec.bos_token_id, spec.eos_token_id), SLICE_TOKENS)
    fired = np.zeros(spec.n_layers)
    model.ffn_hook = lambda trace: fired.__setitem__(trace.layer, fired[trace.layer] + trace.fired.mean(axis=1).sum())
    for start in range(0, len(tokens), spec.max_positions):
        model.forward(tokens[start : start + spec.max_positions], model.new_cache())
    measured = fired / len(tokens)
    expected = np.array([layer["firing_fraction"] for layer in card])
    assert (measured < 0.2).all()  # genuinely sparse in every layer
    # A 4k-token slice (the first documents) of the card's text: per layer within 3 points of the
    # card's figure; layer 0 varies most with the text (0.060 on this slice, 0.083 over all of it).
    np.testing.assert_allclose(measured, expected, atol=0.03)
