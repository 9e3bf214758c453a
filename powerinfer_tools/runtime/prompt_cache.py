"""Prompt reuse: finished sequences' KV caches, kept so that a later prompt beginning with the same tokens (the
next turn of a conversation, a shared system prompt) computes only the rest, as llama.cpp's server does with
``cache_prompt``.

A sequence that ends hands its caches over (``keep``), with the tokens they hold: its prompt and the tokens
generated after it. A new prompt takes a copy of the longest beginning any entry shares with it (``reuse``), so
that the entry stays for others (every request of a shared system prompt). Memory is bounded: the entries'
caches take at most ``max_bytes``, the least recently used dropped first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np

from powerinfer_tools.models.layers import KVCache


class PromptCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, tuple[np.ndarray, list[KVCache]]] = OrderedDict()  # oldest use first
        self._next_key = 0
        self.nbytes = 0  # the entries' caches (an int: read from other threads, /metrics, while entries change)
        self.hits = 0  # prompts that reused a cached beginning
        self.reused_tokens = 0  # prompt tokens not computed for that

    def keep(self, tokens: Sequence[int], caches: list[KVCache]) -> None:
        """Keep ``caches`` (one per layer, taken over: their owner is done with them) for the ``tokens`` they hold,
        the first ``caches[0].length`` of ``tokens``; an entry whose tokens begin these is no longer needed."""
        held = np.asarray(tokens[: caches[0].length], dtype=np.int64)
        if not len(held) or _size(caches) > self.max_bytes:
            return
        for key, (other, _) in list(self._entries.items()):
            if len(other) <= len(held) and np.array_equal(other, held[: len(other)]):
                self._drop(key)
        self._entries[self._next_key] = held, caches
        self.nbytes += _size(caches)
        self._next_key += 1
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))  # the least recently used

    def _drop(self, key: int) -> None:
        self.nbytes -= _size(self._entries.pop(key)[1])

    def reuse(self, prompt: Sequence[int]) -> tuple[list[KVCache] | None, int]:
        """Caches of their own holding the longest beginning of ``prompt`` that an entry holds, at most all but its
        last token (whose logits a generation needs computed), and that beginning's length; (None, 0) where no
        entry begins as it does."""
        wanted = np.asarray(prompt[:-1], dtype=np.int64)
        best, length = None, 0
        for key, (held, _) in self._entries.items():
            shared = _shared_length(held, wanted)
            if shared > length:
                best, length = key, shared
        if best is None:
            return None, 0
        self._entries.move_to_end(best)
        self.hits += 1
        self.reused_tokens += length
        return [cache.prefix(length) for cache in self._entries[best][1]], length


def _shared_length(a: np.ndarray, b: np.ndarray) -> int:
    """How many tokens ``a`` and ``b`` share from their start."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _size(caches: list[KVCache]) -> int:
    return sum(cache.nbytes for cache in caches)
