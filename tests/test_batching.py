"""Continuous batching (``runtime.batching``) computes what one-at-a-time decoding computes: a batch's logits are
each sequence's own within float32 summation order (the batch's products take B rows at once, the compiled
decoder one), greedy tokens are the same, sequences join and leave between steps, and a prompt that begins as a
finished sequence's text reuses its keys and values (``runtime.prompt_cache``) to the same tokens."""

from __future__ import annotations

import numpy as np

from gguf_fixtures import relative_error
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.runtime.batching import BatchDecoder
from powerinfer_tools.runtime.generation import SamplingConfig
from powerinfer_tools.runtime.llm import LLM
from powerinfer_tools.runtime.loader import load_runtime_model
from powerinfer_tools.runtime.prompt_cache import PromptCache

GREEDY = SamplingConfig(temperature=0)
PROMPTS = ["import os\n", "def parse(text):\n    return", "class Node:\n    def __init__(self", "x"]


def _logits_one_by_one_and_batched(model, prompts: list[np.ndarray], steps: int):
    """Per step, every sequence's logits decoded alone (``forward``, the compiled decoder) and together
    (``forward_batch``), feeding both the alone-decoded greedy tokens."""
    alone, together = [model.new_cache() for _ in prompts], [model.new_cache() for _ in prompts]
    last = []
    for prompt, a, b in zip(prompts, alone, together):
        logits = model.forward(prompt, a, all_logits=False)
        model.forward(prompt, b, all_logits=False)
        last.append(int(np.argmax(logits[-1])))
    errors = []
    for _ in range(steps):
        tokens = np.array(last)
        one = np.concatenate([model.forward(tokens[i : i + 1], a, all_logits=False) for i, a in enumerate(alone)])
        batch = model.forward_batch([tokens[i : i + 1] for i in range(len(tokens))], together)
        errors.append(relative_error(batch, one))
        last = list(np.argmax(one, axis=1))
    return errors


def test_a_batch_computes_each_sequences_logits_as_it_alone_would(bundled_gguf):
    model = load_runtime_model(bundled_gguf("f32"))
    model.mode = FFNMode.DENSE
    assert model.decode_path() == "compiled decoder"
    prompts = [np.arange(1, 1 + n) * 7 % model.spec.vocab_size for n in (3, 9, 1, 5)]  # different positions
    errors = _logits_one_by_one_and_batched(model, prompts, steps=6)
    assert max(errors) < 1e-4, errors  # float32 sums in another order, nothing else


def test_a_sparse_batch_computes_each_sequences_neurons(synthesized_tiny):
    model = load_runtime_model(synthesized_tiny.powerinfer)
    model.mode = FFNMode.SPARSE
    prompts = [np.arange(1, 1 + n) * 5 % model.spec.vocab_size for n in (4, 2, 6)]
    errors = _logits_one_by_one_and_batched(model, prompts, steps=4)
    # q4_0: x is encoded as q8_0 by the one-token kernels, as float rows by a block's union of neurons
    assert max(errors) < 0.15, errors


def test_prompts_joining_a_step_are_computed_as_they_alone_would_be(bundled_gguf):
    model = load_runtime_model(bundled_gguf("f32"))
    model.mode = FFNMode.DENSE
    vocab = model.spec.vocab_size
    running = [np.arange(1, 1 + n) * 7 % vocab for n in (3, 6)]  # sequences decoding: a prompt read already
    joining = [np.arange(2, 2 + n) * 5 % vocab for n in (4, 9)]  # prompts starting in the step
    alone, together = ([model.new_cache() for _ in range(4)] for _ in range(2))
    for prompt, a, b in zip(running, alone, together):
        model.forward(prompt, a, all_logits=False)
        model.forward(prompt, b, all_logits=False)
    blocks = [joining[0], np.array([11]), joining[1], np.array([12])]
    order = [alone[2], alone[0], alone[3], alone[1]]
    one = np.concatenate([model.forward(block, a, all_logits=False) for block, a in zip(blocks, order)])
    batch = model.forward_batch(blocks, [together[2], together[0], together[3], together[1]])
    assert batch.shape == one.shape == (4, vocab)
    assert relative_error(batch, one) < 1e-4  # float32 sums in another order, nothing else
    # and the caches hold the same keys afterwards: the next step of each agrees too
    nxt = [np.array([13 + i]) for i in range(4)]
    one = np.concatenate([model.forward(t, a, all_logits=False) for t, a in zip(nxt, alone)])
    assert relative_error(model.forward_batch(nxt, together), one) < 1e-4


def _greedy_tokens(decoder: BatchDecoder, prompt: list[int], n: int) -> list[int]:
    """The ``n`` greedy tokens after ``prompt`` of a sequence decoded alone."""
    sequence = decoder.start(prompt, n, GREEDY)
    while not sequence.finished:
        decoder.step([sequence])
    return sequence.tokens


def _greedy_alone(llm: LLM, prompt: str, n: int) -> list[int]:
    tokens = _greedy_tokens(BatchDecoder(llm), llm.prompt_ids(prompt), n)
    assert "".join(llm.generate(prompt, n)) == llm.tokenizer.decode(tokens)  # LLM.generate's text
    return tokens


def test_sequences_join_and_leave_between_steps_and_keep_their_greedy_tokens(bundled_gguf):
    llm = LLM.load(bundled_gguf("f32"), mode="dense")
    lengths = [12, 5, 8, 1]
    wanted = [_greedy_alone(llm, p, n) for p, n in zip(PROMPTS, lengths)]
    decoder = BatchDecoder(llm)
    running = [decoder.start(llm.prompt_ids(p), n, GREEDY) for p, n in zip(PROMPTS[:2], lengths[:2])]
    done, later, sizes = [], list(zip(PROMPTS[2:], lengths[2:])), []
    while running or later:
        if later and decoder.counters.steps >= 2:  # the others join after two steps
            running += [decoder.start(llm.prompt_ids(p), n, GREEDY) for p, n in later]
            later = []
        done += [s for s in running if s.finished]
        running = [s for s in running if not s.finished]
        if running:
            sizes.append(len(running))
            decoder.step(running)
    by_prompt = {llm.tokenizer.decode(s.prompt): s.tokens for s in done}
    assert [by_prompt[llm.tokenizer.decode(llm.prompt_ids(p))] for p in PROMPTS] == wanted
    assert max(sizes) >= 3 and sizes[-1] == 1  # they ran together, then left one by one


def test_a_prompt_that_begins_as_a_finished_text_reuses_its_cache_to_the_same_tokens(bundled_gguf):
    llm = LLM.load(bundled_gguf("f32"), mode="dense")
    cache = PromptCache(max_bytes=1 << 30)
    decoder = BatchDecoder(llm, cache)
    first = decoder.start(llm.prompt_ids(PROMPTS[1]), 6, GREEDY)
    while not first.finished:
        decoder.step([first])
    decoder.finish(first)  # kept by the prompt cache
    # The next turn: the first request's prompt and answer, then more.
    follow_up = llm.prompt_ids(PROMPTS[1]) + first.tokens + llm.tokenizer.encode(" x")[1:]
    again = decoder.start(follow_up, 5, GREEDY)
    while not again.finished:
        decoder.step([again])
    held = len(first.prompt) + len(first.tokens) - 1  # every token but the last sampled went through the model
    assert again.stats.prompt_reused == held and cache.hits == 1 and cache.reused_tokens == held
    assert again.tokens == _greedy_tokens(BatchDecoder(llm), follow_up, 5)  # the whole prompt computed


def test_the_prompt_cache_keeps_to_its_memory_bound(bundled_gguf):
    llm = LLM.load(bundled_gguf("f32"), mode="dense")
    one = llm.engine.new_cache()
    llm.engine.forward(np.arange(1, 6), one)
    size = sum(c.nbytes for c in one)
    cache = PromptCache(max_bytes=2 * size)
    for first in range(1, 5):  # four texts that share no beginning
        caches = llm.engine.new_cache()
        llm.engine.forward(np.arange(first, first + 5) * 11, caches)
        cache.keep(list(np.arange(first, first + 5) * 11), caches)
    assert cache.nbytes <= 2 * size
    assert cache.reuse(list(np.arange(1, 6) * 11))[1] == 0  # the oldest is gone
    caches, reused = cache.reuse(list(np.arange(4, 9) * 11) + [3])
    assert reused == 5 and caches[0].length == 5
    assert PromptCache(max_bytes=size - 1).keep([1, 2, 3, 4, 5], one) is None  # too large to keep: not kept


def test_a_step_takes_the_way_that_measured_faster_for_its_batch_size_and_tries_the_other_now_and_then():
    from powerinfer_tools.runtime.batching import EXPLORE, _StepChoice

    choice = _StepChoice()
    first = choice.together(3)
    choice.record(3, first, 0.3)
    second = choice.together(3)
    assert second is not first
    choice.record(3, second, 0.9 if second else 0.1)  # one pass per sequence measured faster
    ways = [choice.together(3) for _ in range(2 * EXPLORE)]
    assert ways.count(True) == 2 and ways.count(False) == 2 * EXPLORE - 2  # the faster, the other tried again
    assert choice.together(2) is True  # another batch size: measured apart, untried yet
