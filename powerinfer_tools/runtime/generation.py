"""Token sampling and the generation loop, shared by every engine that produces logits.

Both the command line and the Python API (``llm.LLM``) pass through here, so this is where their
settings are checked (``SamplingConfig``, ``Generation``, ``context_window``): a bad value is a
``SettingError`` naming the setting and its ``pitools run`` option.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np

from powerinfer_tools.errors import PitoolsError


class SettingError(PitoolsError, ValueError):
    """A setting out of its range: one line on the command line (a PitoolsError), and the
    ValueError that Python callers expect of a bad argument."""


def _require(valid: bool, name: str, rule: str, value: Any) -> None:
    if not valid:
        raise SettingError(f"{name}: must be {rule}, not {value!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_whole(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingConfig:
    """``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable those filters."""

    temperature: float = 0.0  # greedy: `pitools run --temp` and LLM.generate by default (the HTTP API: OpenAI's 1)
    top_k: int = 40
    top_p: float = 0.95
    seed: Optional[int] = None

    def __post_init__(self):
        t, p, seed = self.temperature, self.top_p, self.seed
        _require(_is_number(t) and math.isfinite(t) and t >= 0, "temperature (--temp)", "a finite number >= 0", t)
        _require(_is_whole(self.top_k) and self.top_k >= 0, "top_k (--top-k)", "a whole number >= 0", self.top_k)
        _require(_is_number(p) and 0 < p <= 1, "top_p (--top-p)", "in (0, 1]", p)
        # NumPy's generators take any non-negative integer; 64 bits is what a seed can usefully hold.
        _require(seed is None or (_is_whole(seed) and 0 <= seed < 2**64), "seed (--seed)",
                 "a whole number from 0 to 2^64 - 1", seed)


class NonFiniteLogits(PitoolsError):
    """The model produced a NaN or infinite logit: its weights are damaged (or were changed under a
    run that reads them from the file), and no token can be sampled from it."""


DRAW_BLOCK = 1024  # weights summed at a time by ``Sampler._draw``
FLOAT32_TINY = float(np.finfo(np.float32).tiny)


class Sampler:
    """Picks the next token from a logits vector; reproducible for a given seed."""

    def __init__(self, config: SamplingConfig):
        self.config = config
        self.rng = np.random.default_rng(config.seed)

    def __call__(self, logits: np.ndarray) -> int:
        c = self.config
        if not finite_logits(logits):
            raise NonFiniteLogits("the model's logits are not finite (NaN or infinity): its weights are damaged, "
                                  "or the model file changed while it was being read")
        if c.temperature == 0:
            return int(np.argmax(logits))
        # In float32: NumPy's exp is vectorized for it, and a probability it rounds to 0 (below e^-87 of the
        # likeliest token's) is one no draw would pick anyway.
        logits = logits.astype(np.float32, copy=False)
        if not c.top_k and c.top_p >= 1:  # every token, as likely as its probability: no order needed
            return self._draw(_scaled_exp(logits - logits.max(), c.temperature))
        order = _likeliest(logits, c.top_k) if c.top_k else _nucleus(logits, c.top_p, c.temperature)
        weights = _scaled_exp(logits[order] - logits[order[0]], c.temperature)
        if c.top_p < 1:
            # Keep the smallest head of the sorted distribution whose mass reaches top_p.
            keep = int(np.searchsorted(np.cumsum(weights), c.top_p * weights.sum()) + 1)
            weights, order = weights[:keep], order[:keep]
        return int(order[self._draw(weights)])

    def _draw(self, weights: np.ndarray) -> int:
        """An index drawn in proportion to ``weights`` (as ``Generator.choice`` with ``p``, without checking and
        normalizing a vocabulary-sized ``p`` first): the block that the draw falls in by the blocks' sums, then
        the index within it. A running sum over the whole vocabulary is sequential, and costs more than all the
        vectorized arithmetic before it."""
        starts = np.arange(0, len(weights), DRAW_BLOCK)
        block_cdf = np.cumsum(np.add.reduceat(weights, starts, dtype=np.float64))
        target = self.rng.random() * block_cdf[-1]
        block = min(int(np.searchsorted(block_cdf, target, side="right")), len(starts) - 1)
        within = target - (block_cdf[block - 1] if block else 0.0)
        cdf = np.cumsum(weights[starts[block] : starts[block] + DRAW_BLOCK], dtype=np.float64)
        return int(starts[block]) + min(int(np.searchsorted(cdf, within, side="right")), len(cdf) - 1)


def _scaled_exp(differences: np.ndarray, temperature: float) -> np.ndarray:
    """exp(differences / temperature) for differences from the largest logit. They are scaled, not the logits:
    divided by a subnormal temperature (5e-324 is a valid one) a logit overflows to infinity, and inf - inf is NaN.
    A difference overflowing to -infinity is a probability of 0, as it should be. A temperature below float32's
    smallest normal number is taken as that number, which float32 differences can be divided by: either keeps
    the likeliest token(s) alone."""
    with np.errstate(over="ignore"):
        return np.exp(differences / max(temperature, FLOAT32_TINY))


def _nucleus(logits: np.ndarray, top_p: float, temperature: float) -> np.ndarray:
    """Token ids by falling logit (ties in id order), at least as many as hold ``top_p`` of the probability: the
    head of a stable full sort, found without one (a full sort of a 49,152-token vocabulary costs several times a
    small model's token), by sorting a growing head until it holds that mass."""
    weights = _scaled_exp(logits - logits.max(), temperature)
    total, head = weights.sum(), 64
    while True:
        order = _likeliest(logits, min(head, len(logits)))
        if head >= len(logits) or weights[order].sum() >= top_p * total:
            return order
        head *= 8


def finite_logits(logits: np.ndarray) -> bool:
    """Whether a token can be sampled from each row of ``logits`` (one token's, or ``[T, vocab]``): no NaN, no
    +infinity, and some finite logit. A -infinity logit is a token with probability 0. One pass, no copy: a row's
    maximum is NaN where any of its values is (NumPy's ``max`` propagates NaN), +infinity where one is, and
    -infinity where all are."""
    return bool(np.isfinite(logits.max(axis=-1)).all())


def _likeliest(logits: np.ndarray, top_k: int) -> np.ndarray:
    """Token ids by falling logit, the ``top_k`` likeliest only (all when 0), ties in id order: what a
    stable full sort gives, but the top k are partitioned out first (a full sort is what a vocabulary's
    size makes costly)."""
    if 0 < top_k < len(logits):
        kth = np.partition(logits, len(logits) - top_k)[len(logits) - top_k]  # the k-th largest logit
        above = np.flatnonzero(logits > kth)
        head = np.concatenate([above, np.flatnonzero(logits == kth)[: top_k - len(above)]])
        return head[np.argsort(-logits[head], kind="stable")]
    return np.argsort(-logits, kind="stable")


# Given the next tokens (the prompt first, then one at a time), the logits of the last one.
StepFn = Callable[[np.ndarray], np.ndarray]


def context_window(max_positions: int, requested: Optional[int] = None) -> int:
    """The context window: ``requested`` positions (``-c/--ctx-size``), by default and at most the
    ``max_positions`` the model was trained for (beyond them a learned position table has no rows)."""
    if requested is None:
        return max_positions
    _require(_is_whole(requested) and 1 <= requested <= max_positions, "context size (-c/--ctx-size)",
             f"a whole number from 1 to the model's {max_positions} positions", requested)
    return int(requested)


class PromptTooLong(SettingError):
    """A prompt with more tokens than the context window holds."""


def check_prompt(prompt: list[int], context_size: Optional[int]) -> None:
    """A prompt can start a generation: it has tokens, and they fit the window."""
    if not prompt:
        raise SettingError("prompt: no tokens to start from (an empty prompt, and no BOS token); give some text")
    if context_size is not None and len(prompt) > context_size:
        raise PromptTooLong(f"prompt is {len(prompt)} tokens; the context window holds {context_size}")


class Generation:
    """The tokens sampled after ``prompt``, as an iterator: up to ``max_new_tokens``, ending after a
    token in ``stop_ids`` (then ``stopped_at_token`` becomes True), or once prompt and generated tokens
    fill the ``context_size`` positions of the context window (then ``stopped_at_window`` does).
    ``sampled`` counts the tokens yielded so far.

    The arguments are checked here, before ``step`` runs: a prompt that does not fit the window is
    refused before its forward pass allocates anything (attention over a prompt grows with the
    square of its length).
    """

    def __init__(self, step: StepFn, prompt: list[int], max_new_tokens: int, sampler: Sampler,
                 stop_ids: Iterable[int] = (), context_size: Optional[int] = None):
        _require(_is_whole(max_new_tokens) and max_new_tokens >= 0, "tokens to generate (-n/--n-tokens)",
                 "a whole number >= 0", max_new_tokens)
        check_prompt(prompt, context_size)
        room = max_new_tokens if context_size is None else context_size - len(prompt)
        self.step, self.prompt, self.sampler, self.stop = step, list(prompt), sampler, set(stop_ids)
        self.count = min(max_new_tokens, room)
        self.cut_by_window = room < max_new_tokens  # the window, not max_new_tokens, sets count
        self.stopped_at_token = False
        self.stopped_at_window = self.cut_by_window and self.count == 0  # a prompt that fills the window
        self.sampled = 0

    def __iter__(self) -> Iterator[int]:
        logits = self.step(np.asarray(self.prompt, dtype=np.int64))
        while not self.finished:
            token = self.next_token(logits)
            yield token
            if not self.finished:  # the last token's forward pass would feed no one
                logits = self.step(np.asarray([token], dtype=np.int64))

    def next_token(self, logits: np.ndarray) -> int:
        """The token sampled from ``logits`` (the last forward pass's), counted; ``finished`` says whether another
        forward pass is wanted. A batch of generations calls it for each of its sequences (``runtime.batching``),
        iterating calls it for one."""
        token = self.sampler(logits)
        self.sampled += 1
        self.stopped_at_token = token in self.stop
        self.stopped_at_window = self.cut_by_window and self.sampled >= self.count and not self.stopped_at_token
        return token

    @property
    def finished(self) -> bool:
        """Whether the generation has ended: a stop token sampled, or ``count`` tokens."""
        return self.stopped_at_token or self.sampled >= self.count


def generate(step: StepFn, prompt: list[int], max_new_tokens: int, sampler: Sampler, stop_ids: Iterable[int] = (),
             context_size: Optional[int] = None) -> Generation:
    """The tokens sampled after ``prompt`` (see ``Generation``); checked now, computed as iterated."""
    return Generation(step, prompt, max_new_tokens, sampler, stop_ids, context_size)


def stream_text(tokens: Iterable[int], decode: Callable[[list[int]], str]) -> Iterator[str]:
    """Turn a token stream into text pieces, holding back an incomplete UTF-8 character (``TextPieces``)."""
    pieces = TextPieces(decode)
    for token in tokens:
        if text := pieces.feed(token):
            yield text
    if text := pieces.flush():
        yield text


class TextPieces:
    """Tokens in, text pieces out, one token at a time (``feed``, then ``flush`` at the end).

    Byte-level tokens can split one character across tokens; decoding such a prefix gives U+FFFD, so
    a piece is released only once it ends in a complete character. Each step decodes a short window,
    from the token after the piece before last (``start``) on, not the whole text: decoding everything
    again per token grew with the text. Removing the window's first part,
    ``decode(ids[start:released])``, as text rather than as tokens keeps what a tokenizer does to a
    text's start (a SentencePiece decoder drops its leading space) out of the pieces.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.start = self.released = 0  # ids[start:released]: the tokens of the last piece released

    def feed(self, token: int) -> str:
        """The text ``token`` completes ("" while a character is incomplete)."""
        self.ids.append(token)
        before, text = self._window()
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self.start, self.released = self.released, len(self.ids)
            return text[len(before):]
        return ""

    def flush(self) -> str:
        """What is held back once no token follows."""
        before, text = self._window()
        return text[len(before):] if len(text) > len(before) else ""

    def _window(self) -> tuple[str, str]:
        return self.decode(self.ids[self.start : self.released]), self.decode(self.ids[self.start :])
