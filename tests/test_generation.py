"""Sampling and streamed detokenisation."""

from __future__ import annotations

import numpy as np
import pytest

from powerinfer_tools.runtime.generation import NonFiniteLogits, Sampler, SamplingConfig, generate, stream_text

LOGITS = np.log(np.array([0.05, 0.5, 0.3, 0.1, 0.05]))


def draws(config: SamplingConfig, n: int = 400) -> np.ndarray:
    sampler = Sampler(config)
    return np.array([sampler(LOGITS) for _ in range(n)])


def test_greedy_is_argmax():
    assert set(draws(SamplingConfig(temperature=0), 10)) == {1}


def test_top_k_and_top_p_restrict_the_candidates():
    assert set(draws(SamplingConfig(temperature=1, top_k=2, top_p=1))) == {1, 2}
    # 0.5 + 0.3 = 0.8 reaches top_p = 0.75: only the two likeliest remain.
    assert set(draws(SamplingConfig(temperature=1, top_k=0, top_p=0.75))) == {1, 2}
    assert set(draws(SamplingConfig(temperature=1, top_k=0, top_p=1))) == {0, 1, 2, 3, 4}


def test_temperature_one_follows_the_distribution():
    counts = np.bincount(draws(SamplingConfig(temperature=1, top_k=0, top_p=1, seed=1), 4000), minlength=5)
    assert np.allclose(counts / 4000, np.exp(LOGITS), atol=0.03)


def test_seed_makes_sampling_reproducible():
    config = SamplingConfig(temperature=1.5, top_k=0, top_p=1, seed=42)
    assert (draws(config, 50) == draws(config, 50)).all()
    assert not (draws(config, 50) == draws(SamplingConfig(temperature=1.5, top_k=0, top_p=1, seed=43), 50)).all()


def test_bad_sampling_settings_are_rejected():
    with pytest.raises(ValueError):
        SamplingConfig(temperature=-1)
    with pytest.raises(ValueError):
        SamplingConfig(top_p=0)


def test_generate_feeds_back_tokens_and_stops_at_eos():
    fed = []

    def step(tokens):
        fed.append(tokens.tolist())
        logits = np.zeros(5)
        logits[(tokens[-1] + 1) % 5] = 1  # always predicts the next id
        return logits

    out = list(generate(step, [1, 2], 10, Sampler(SamplingConfig(temperature=0)), stop_ids=[0]))
    assert out == [3, 4, 0]
    assert fed == [[1, 2], [3], [4]]


def test_stream_text_never_splits_a_character():
    data = "añ€😀 ok".encode()
    byte_tokens = list(data)  # one token per byte: multi-byte characters span tokens

    def decode(ids):
        return bytes(ids).decode("utf-8", errors="replace")

    pieces = list(stream_text(byte_tokens, decode))
    assert "".join(pieces) == "añ€😀 ok"
    assert all("\ufffd" not in p for p in pieces)


def test_top_k_keeps_what_a_full_stable_sort_keeps():
    # Many ties: the k-th likeliest is shared by several ids, and the lowest ids among them are kept.
    rng = np.random.default_rng(1)
    for _ in range(200):
        logits = rng.integers(-3, 3, int(rng.integers(1, 60))).astype(np.float64)
        k = int(rng.integers(1, len(logits) + 1))
        kept = set(np.argsort(-logits, kind="stable")[:k].tolist())
        sampler = Sampler(SamplingConfig(temperature=100, top_k=k, top_p=1, seed=0))  # nearly uniform over them
        drawn = {sampler(logits) for _ in range(20 * k)}
        assert drawn == kept


def test_stream_text_decodes_a_short_window_per_token():
    words = ["▁a", "b", "▁c€", "▁d", "e"] * 200
    vocab = sorted(set(words))
    seen = []

    def decode(ids):  # SentencePiece-like: "▁" is a space, and a text's leading space is dropped
        seen.append(len(ids))
        return "".join(vocab[i] for i in ids).replace("▁", " ").lstrip(" ")

    tokens = [vocab.index(w) for w in words]
    assert "".join(stream_text(tokens, decode)) == decode(tokens)
    assert max(seen[:-1]) <= 3  # not the whole text again at every token


def test_stream_text_holds_back_only_until_the_character_completes():
    data = "a€b".encode()  # € is 3 bytes: three tokens
    pieces = list(stream_text(list(data), lambda ids: bytes(ids).decode("utf-8", errors="replace")))
    assert pieces == ["a", "€", "b"]


def test_stream_text_flushes_an_unfinished_character_at_the_end():
    data = "a".encode() + "€".encode()[:2]
    pieces = list(stream_text(list(data), lambda ids: bytes(ids).decode("utf-8", errors="replace")))
    assert "".join(pieces) == "a\ufffd"


@pytest.mark.parametrize("temperature", [5e-324, 1e-310, 1e-300, 1e-30])
def test_a_tiny_temperature_samples_the_likeliest_token(temperature):
    # Logits divided by a subnormal temperature overflow to infinity; inf - inf is NaN. Scaling the
    # differences from the largest logit instead keeps every probability finite.
    sampler = Sampler(SamplingConfig(temperature=temperature, top_k=0, top_p=0.95, seed=0))
    assert {sampler(LOGITS) for _ in range(20)} == {1}


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("temperature", [0, 0.8])
def test_nan_or_infinite_logits_are_one_clear_error(bad, temperature):
    logits = LOGITS.copy()
    logits[3] = bad
    with pytest.raises(NonFiniteLogits, match="not finite"):
        Sampler(SamplingConfig(temperature=temperature, seed=0))(logits)


def test_a_logit_of_minus_infinity_is_a_token_never_sampled():
    logits = LOGITS.copy()
    logits[1] = -np.inf
    drawn = {Sampler(SamplingConfig(temperature=1, top_k=0, top_p=1, seed=s))(logits) for s in range(200)}
    assert drawn == {0, 2, 3, 4}
    with pytest.raises(NonFiniteLogits):
        Sampler(SamplingConfig(temperature=1))(np.full(5, -np.inf))


def test_the_nucleus_is_the_head_of_a_stable_full_sort():
    """Found from a growing head, it is what sorting every logit (ties in id order) would give, up to the mass."""
    from powerinfer_tools.runtime.generation import _nucleus

    rng = np.random.default_rng(3)
    for vocab, top_p in [(10, 0.5), (1000, 0.9), (5000, 0.999), (300, 1.0)]:
        logits = np.round(rng.normal(size=vocab) * 3, 1)  # rounded: many ties
        full = np.argsort(-logits, kind="stable")
        weights = np.exp((logits - logits.max()) / 0.7)
        head = _nucleus(logits, top_p, 0.7)
        assert head.tolist() == full[: len(head)].tolist()
        assert weights[head].sum() >= top_p * weights.sum() * (1 - 1e-12)


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (0, 0.8), (3, 1.0)])
def test_sampling_draws_tokens_as_often_as_their_probability(top_k, top_p):
    logits = np.array([0.0, 1.0, 2.0, 3.0, 2.0], dtype=np.float32)
    sampler = Sampler(SamplingConfig(temperature=1.0, top_k=top_k, top_p=top_p, seed=0))
    drawn = np.bincount([sampler(logits) for _ in range(20000)], minlength=5) / 20000
    probs = np.exp(logits - logits.max())
    order = np.argsort(-logits, kind="stable")[: top_k or None]
    keep = order[: int(np.searchsorted(np.cumsum(probs[order]) / probs[order].sum(), top_p) + 1)]
    expected = np.zeros(5)
    expected[keep] = probs[keep] / probs[keep].sum()
    np.testing.assert_allclose(drawn, expected, atol=0.015)


def test_a_draw_over_a_vocabulary_of_many_blocks_follows_the_distribution():
    """The draw finds a block by the blocks' sums, then the token within it: tokens at a block's edges, in the
    first and the last (a partial) block, each drawn as often as their probability."""
    from powerinfer_tools.runtime.generation import DRAW_BLOCK

    vocab = 4 * DRAW_BLOCK + 100
    likely = np.array([0, DRAW_BLOCK - 1, DRAW_BLOCK, 3 * DRAW_BLOCK + 7, vocab - 1])
    logits = np.full(vocab, -40.0, dtype=np.float32)  # the rest: about 1e-13 of the mass in all
    logits[likely] = [0.0, 1.0, 2.0, 3.0, 2.0]
    sampler = Sampler(SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, seed=1))
    drawn = np.array([sampler(logits) for _ in range(20000)])
    assert np.isin(drawn, likely).all()
    probs = np.exp(logits[likely] - 3.0)
    np.testing.assert_allclose([np.mean(drawn == t) for t in likely], probs / probs.sum(), atol=0.015)
