"""Our runtime's side of the oracle comparisons (tests/oracle_decoding.py holds transformers' and llama.cpp's): a
file's logits at every prompt position and its greedy continuation, the prompt's last tokens and the continuation
one token at a time, on the compiled decoder or the general path."""

from __future__ import annotations

import numpy as np
from oracle_decoding import STEPS

from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.runtime.loader import load_runtime_model

ONE_AT_A_TIME = 8  # the prompt's last tokens, decoded one at a time after the rest as one block


def runtime_logits_and_greedy(path, ids: list[int], compiled: bool, steps: int = STEPS, mode=FFNMode.DENSE,
                               context_size: int | None = None):
    """Our runtime's logits at every prompt position (a block, then ONE_AT_A_TIME tokens one by one) and its greedy
    continuation of ``steps`` tokens, in a context window of ``context_size`` positions (default: the model's)."""
    model = load_runtime_model(path, context_size=context_size)
    model.compiled_decoding, model.mode = compiled, mode
    caches, cut = model.new_cache(), len(ids) - ONE_AT_A_TIME
    logits = [model.forward(np.array(ids[:cut]), caches)]
    logits += [model.forward(np.array(ids[i : i + 1]), caches) for i in range(cut, len(ids))]
    continuation, last = [], logits[-1][-1]
    for _ in range(steps):
        continuation.append(int(last.argmax()))
        last = model.forward(np.array(continuation[-1:]), caches)[-1]
    return np.concatenate(logits).astype(np.float64), continuation, model
