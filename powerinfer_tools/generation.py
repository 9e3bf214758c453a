"""Token sampling and the generation loop, shared by every engine that produces logits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

import numpy as np


@dataclass(frozen=True)
class SamplingConfig:
    """``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable those filters."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    seed: Optional[int] = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")


class Sampler:
    """Picks the next token from a logits vector; reproducible for a given seed."""

    def __init__(self, config: SamplingConfig):
        self.config = config
        self.rng = np.random.default_rng(config.seed)

    def __call__(self, logits: np.ndarray) -> int:
        c = self.config
        if c.temperature == 0:
            return int(np.argmax(logits))
        logits = logits.astype(np.float64) / c.temperature
        order = np.argsort(-logits, kind="stable")
        if c.top_k:
            order = order[: c.top_k]
        probs = np.exp(logits[order] - logits[order[0]])
        probs /= probs.sum()
        if c.top_p < 1:
            # Keep the smallest head of the sorted distribution whose mass reaches top_p.
            keep = int(np.searchsorted(np.cumsum(probs), c.top_p) + 1)
            probs = probs[:keep] / probs[:keep].sum()
            order = order[:keep]
        return int(order[self.rng.choice(len(order), p=probs)])


# Given the next tokens (the prompt first, then one at a time), the logits of the last one.
StepFn = Callable[[np.ndarray], np.ndarray]


def generate(
    step: StepFn, prompt: list[int], max_new_tokens: int, sampler: Sampler, stop_ids: Iterable[int] = ()
) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` sampled tokens; stop after a token in ``stop_ids``."""
    stop = set(stop_ids)
    logits = step(np.asarray(prompt, dtype=np.int64))
    for _ in range(max_new_tokens):
        token = sampler(logits)
        yield token
        if token in stop:
            return
        logits = step(np.asarray([token], dtype=np.int64))


def stream_text(tokens: Iterable[int], decode: Callable[[list[int]], str]) -> Iterator[str]:
    """Turn a token stream into text pieces, holding back an incomplete UTF-8 character.

    Byte-level tokens can split one character across tokens; decoding such a
    prefix gives U+FFFD, so text is released only up to the last complete one.
    """
    ids: list[int] = []
    emitted = 0
    for token in tokens:
        ids.append(token)
        text = decode(ids)
        complete = len(text) - 1 if text.endswith("\ufffd") else len(text)
        if complete > emitted:
            yield text[emitted:complete]
            emitted = complete
    text = decode(ids)
    if len(text) > emitted:
        yield text[emitted:]
