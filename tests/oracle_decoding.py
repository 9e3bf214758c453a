"""What the two oracles compute on the same tokens: transformers on a checkpoint, llama.cpp (llama-cpp-python) on
a GGUF file: the logits of every prompt position, and a greedy continuation."""

from __future__ import annotations

import numpy as np
import torch
from gguf_fixtures import SAMPLE_TEXTS, llama

PROMPT = "\n".join(SAMPLE_TEXTS)  # ~190 tokens: rope at positions where every scaling shows
STEPS = 24  # greedy tokens compared
# Relative (Frobenius) error of llama.cpp's logits, as tests/test_llamacpp_dense.py bounds it: f32 files, and f16
# files (whose weights are rounded) against transformers on the f32 checkpoint.
F32_ERROR, F16_ERROR = 1e-4, 1e-2


def prompt_ids(path) -> list[int]:
    """The prompt as llama.cpp tokenizes it for the file (a BOS first where the file says to add one)."""
    return llama(path, vocab_only=True).tokenize(PROMPT.encode(), add_bos=True, special=False)


def transformers_logits(model, ids: list[int]) -> np.ndarray:
    """(len(ids), n_vocab) float64: every position's logits, the prompt in one forward pass."""
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].double().numpy()


def transformers_greedy(model, ids: list[int], steps: int) -> list[int]:
    """The ``steps`` tokens greedy decoding appends to ``ids`` in transformers, each from a forward pass over the
    whole sequence so far (``generate`` would stop at, or with ``min_new_tokens`` refuse, the end-of-text token;
    llama.cpp's side goes through its KV cache); the output layer on the last position only."""
    continuation = []
    with torch.no_grad():
        for _ in range(steps):
            hidden = model.model(torch.tensor([ids + continuation]), use_cache=False).last_hidden_state
            continuation.append(int(model.lm_head(hidden[0, -1]).argmax()))
    return continuation


def llamacpp_logits_and_greedy(path, ids: list[int], steps: int) -> tuple[np.ndarray, list[int]]:
    """llama.cpp's logits at every position of ``ids`` (float64), and the ``steps`` tokens its greedy decoding
    appends, one at a time through its KV cache (f32: its default f16 cache alone costs ~1e-3 relative error).
    One thread: on models this small, ggml's threads spend longer at the barrier after each operation than in
    it, many times longer when the machine's cores are busy."""
    llm = llama(path, n_ctx=len(ids) + steps + 1, logits_all=True, n_threads=1, n_threads_batch=1, type_k=0,
                type_v=0)
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float64)
    continuation, last = [], logits[-1]
    for _ in range(steps):
        continuation.append(int(last.argmax()))
        llm.eval(continuation[-1:])
        last = np.asarray(llm.scores[llm.n_tokens - 1])
    return logits, continuation


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two continuations share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """Frobenius norm of the difference relative to ``want``'s (tests/test_llamacpp_dense.py's measure)."""
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))
