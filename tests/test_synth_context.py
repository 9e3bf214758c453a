"""Context models (``Planting.context``): firing that depends on the earlier tokens, profiled on text."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from gguf_fixtures import FAST_TRAINING

from powerinfer_tools.benchmarking.bench import TEXT as BENCH_TEXT
from powerinfer_tools.benchmarking.synth import (
    SHAPES,
    LayerByLayer,
    Planting,
    synthesize,
    text_profile_tokens,
    write_checkpoint,
)
from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.conversion.sparsify import work_folder
from powerinfer_tools.formats.profile_folder import read_profile_json
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.interfaces import tracing
from powerinfer_tools.models import load_model
from powerinfer_tools.predictors.trainer import held_out_pairs

CONTEXT = 0.6


@pytest.fixture(scope="module")
def tokenizer():
    checkpoint = Checkpoint(BUNDLED_MODEL)
    return checkpoint.tokenizer(load_model(checkpoint, layers=range(0)).spec)


@pytest.fixture(scope="module")
def text(tokenizer):
    return text_profile_tokens(tokenizer, 4096, 1024)


def gate_pre_activations(model, tokens: np.ndarray) -> dict[int, np.ndarray]:
    """Every layer's gate pre-activations (a dense shape's) on ``tokens``, one window."""
    seen = {}
    with tracing(model, lambda trace: seen.__setitem__(trace.layer, trace.gate_pre)):
        model.forward(tokens, model.new_cache())
    return seen


def within_id_share(values: np.ndarray, tokens: np.ndarray, min_count: int = 4) -> float:
    """Of the variance of ``values [T, n]`` over the tokens whose id occurs ``min_count`` times or more, the
    share within ids (pooled over the columns): 0 when the id alone decides the values."""
    ids, inverse, counts = np.unique(tokens, return_inverse=True, return_counts=True)
    kept = counts[inverse] >= min_count
    v, group = values[kept].astype(np.float64), inverse[kept]
    means = np.zeros((len(ids), v.shape[1]))
    np.add.at(means, group, v)
    means /= np.maximum(counts, 1)[:, None]
    return float(((v - means[group]) ** 2).sum() / ((v - v.mean(axis=0)) ** 2).sum())


@pytest.mark.parametrize("context", [0.0, CONTEXT])
def test_the_share_of_a_gate_that_varies_within_an_id_is_what_earlier_tokens_wrote(tmp_path, context):
    """The reference engine on 64 ids in random order (each id's earlier tokens independent of it): per layer,
    the variance of the gate pre-activations between occurrences of the same id is the share of the FFN input
    that earlier tokens wrote (``Planting.latent_gain``), none without context; the neurons still fire with
    the planted density. (On text, whose tokens follow each other less at random, less of it varies.)"""
    shape, planting = SHAPES["test-tiny"], Planting(density=0.1, context=context)
    write_checkpoint(tmp_path, shape, planting)
    tokens = np.random.default_rng(0).integers(0, 64, 1024)
    gates = gate_pre_activations(load_model(Checkpoint(tmp_path)), tokens)
    for layer, gate in gates.items():
        written = 1 - 1 / planting.latent_gain(layer, shape.n_layers)
        assert within_id_share(gate, tokens) == pytest.approx(written, abs=0.08), layer
        assert (gate > 0).mean() == pytest.approx(0.1, abs=0.025)
    if not context:
        assert max(within_id_share(g, tokens) for g in gates.values()) < 0.01


def test_layer_by_layer_runs_as_the_whole_reference_engine(tmp_path, text):
    write_checkpoint(tmp_path, SHAPES["test-tiny-moe"], Planting(density=0.1, context=CONTEXT))
    whole, streamed = load_model(Checkpoint(tmp_path)), LayerByLayer(Checkpoint(tmp_path))
    traces = []
    for model in (whole, streamed):
        seen = []
        with tracing(model, lambda trace: seen.append((trace.layer, trace.expert, trace.tokens, trace.gate_pre))):
            model.forward(text[:300], model.new_cache())
        traces.append(seen)
    assert len(traces[0]) == len(traces[1]) > 2
    for a, b in zip(*traces):
        assert a[:2] == b[:2] and np.array_equal(a[2], b[2]) and np.array_equal(a[3], b[3])


def ngrams(tokens: np.ndarray, n: int = 24) -> set[bytes]:
    windows = np.lib.stride_tricks.sliding_window_view(np.asarray(tokens, np.int32), n)
    return {w.tobytes() for w in windows}


def test_profile_text_the_held_out_pairs_and_the_bench_share_no_passage(tokenizer, text):
    training, held_out = text[:3072], text[3072:]
    bench = np.asarray(tokenizer.encode(BENCH_TEXT.read_text(encoding="utf-8"), add_bos=False))
    assert len(set(training.tolist())) > 500  # text, not a few ids
    assert not ngrams(training) & ngrams(held_out)
    assert not (ngrams(training) | ngrams(held_out)) & ngrams(bench)
    assert np.array_equal(text_profile_tokens(tokenizer, 4096, 1024), text)  # the same on every run


def test_too_much_text_asked_for_is_one_clear_error(tokenizer):
    with pytest.raises(PitoolsError, match="too short for"):
        text_profile_tokens(tokenizer, 10**9, 1000)


def test_a_context_model_is_profiled_on_text_and_converted(tmp_path, tokenizer):
    output = tmp_path / "c.powerinfer.gguf"
    result = synthesize("test-tiny", output, "q8_0", Planting(density=0.1, context=CONTEXT), profile_tokens=1024,
                        train=FAST_TRAINING, progress=False, keep_work=True)
    assert result.summary()["context"] == CONTEXT
    assert result.profiled_density == pytest.approx(0.1, abs=0.025)
    profile = read_profile_json(work_folder(output) / "profile")
    assert "Python standard library" in profile["corpus"][0]
    tokens = text_profile_tokens(tokenizer, 1024, held_out_pairs(1024, FAST_TRAINING))
    assert profile["corpus_sha256"] == hashlib.sha256(tokens.astype("<i4").tobytes()).hexdigest()


def test_a_rank_wider_than_the_kv_heads_is_refused(tmp_path):
    with pytest.raises(PitoolsError, match="latent rank of at most 32"):
        write_checkpoint(tmp_path, SHAPES["test-tiny"], Planting(rank=40, context=CONTEXT))
