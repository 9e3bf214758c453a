"""Continuous batching: the generations running at once decoded together, one forward pass per step.

A server's requests each become a ``Sequence``, which joins the batch with its prompt (beyond what the prompt
cache holds of it: ``prompt_cache``) still to compute. Each ``step`` samples one token of every sequence: every
running sequence's last token and every joining sequence's prompt go through one forward pass
(``RuntimeModel.forward_batch``: each weight read once for all of their rows, each sequence attending over its
own KV cache), so that the running generations go on while a prompt is computed, and prompts that arrive
together are computed as one block. A step of running sequences alone takes, where that measured faster on this
model and machine, one compiled pass per sequence instead (``_StepChoice``). Sequences join and leave between
steps; each samples from its own logits with its own sampler, stop tokens and window, as ``Generation`` does for
one.
"""

from __future__ import annotations

import collections
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from powerinfer_tools.runtime.engine import RuntimeModel
from powerinfer_tools.runtime.generation import Generation, Sampler, SamplingConfig
from powerinfer_tools.runtime.llm import LLM, GenerationStats
from powerinfer_tools.runtime.prompt_cache import PromptCache

DEFAULT_PARALLEL = 4  # generations a server decodes together (``pitools serve --parallel``), as llama.cpp's server


@dataclass
class Sequence:
    """One generation in a batch: its prompt, what it sampled, its state in the model (``caches``)."""

    prompt: list[int]
    generation: Generation  # its sampler, stop tokens and window
    caches: object  # the engine's cache(s) for it: what ``forward`` extends
    stats: GenerationStats
    unread: np.ndarray  # the prompt's tokens its caches do not hold yet: computed by its first step
    tokens: list[int] = field(default_factory=list)  # sampled so far

    @property
    def finished(self) -> bool:
        return self.generation.finished


@dataclass
class BatchCounters:
    """What the steps of a ``BatchDecoder`` computed: steps, the tokens they sampled (one per sequence), the
    prompt tokens they computed (of sequences joining), their time, and the steps of more than one sequence
    computed in one forward pass (the others: one pass per sequence)."""

    steps: int = 0
    tokens: int = 0
    prompt_tokens: int = 0
    seconds: float = 0.0
    batched: int = 0


# A batch of B sequences decodes a token each in one forward pass (``forward_batch``: each weight read once, the
# general path's layers) or in B passes of the compiled one-token decoder, whichever took less time per token over
# its last TIMED steps of that B on this model and machine; the other is tried again every EXPLORE steps. Where the
# line falls depends on the model: a small one whose weights stay in cache gains little from reading them once, and
# its products cost as much per token either way (``examples/batching_gain.py`` measures it).
TIMED = 8
EXPLORE = 32


class _StepChoice:
    """Per batch size, the seconds per token of its recent steps each way; which way the next step takes."""

    def __init__(self):
        self._seconds: dict[tuple[int, bool], collections.deque] = {}
        self._steps = 0

    def together(self, size: int) -> bool:
        """Whether the next step of ``size`` sequences runs as one forward pass."""
        self._steps += 1
        timed = {way: self._seconds.setdefault((size, way), collections.deque(maxlen=TIMED)) for way in (True, False)}
        untried = [way for way, seconds in timed.items() if not seconds]
        if untried:
            return untried[0]
        faster = statistics.median(timed[True]) <= statistics.median(timed[False])
        return faster if self._steps % EXPLORE else not faster

    def record(self, size: int, together: bool, seconds: float) -> None:
        self._seconds[size, together].append(seconds / size)


class BatchDecoder:
    """Starts sequences and steps them together on ``llm``'s model; ``prompt_cache``, where given (the runtime
    only), keeps finished sequences' caches for later prompts."""

    def __init__(self, llm: LLM, prompt_cache: PromptCache | None = None):
        self.llm, self.engine = llm, llm.engine
        self.batched = isinstance(llm.engine, RuntimeModel)  # the reference engine runs its sequences in turn
        self.prompt_cache = prompt_cache if self.batched else None
        self.counters = BatchCounters()
        self._choice = _StepChoice()

    def start(self, prompt: list[int], max_tokens: int, sampling: SamplingConfig) -> Sequence:
        """A sequence of ``prompt`` (ids, checked as ``LLM.prompt_ids`` checks them), to join the next ``step``:
        that step computes its prompt and samples its first token (none where ``max_tokens`` is 0 or the prompt
        fills the window: it is finished already, and nothing is computed)."""
        eos = self.engine.spec.eos_token_id
        generation = Generation(None, prompt, max_tokens, Sampler(sampling), [eos] if eos is not None else [],
                                self.llm.context_size)
        stats = GenerationStats(prompt_tokens=len(prompt), context_size=self.llm.context_size)
        caches, reused = self.prompt_cache.reuse(prompt) if self.prompt_cache is not None else (None, 0)
        stats.prompt_reused = reused
        return Sequence(prompt, generation, self.engine.new_cache() if caches is None else caches, stats,
                        np.asarray(prompt[reused:], dtype=np.int64))

    def step(self, sequences: list[Sequence]) -> None:
        """Each of ``sequences`` (none finished) samples its next token (a joining one: its first, after its
        prompt), from one forward pass over their last tokens and prompts."""
        blocks = [s.unread if len(s.unread) else np.array(s.tokens[-1:], dtype=np.int64) for s in sequences]
        joining = [len(s.unread) > 0 for s in sequences]
        decoding = self.batched and len(sequences) > 1 and not any(joining)  # a step the choice times
        # A step with a prompt in it runs as one pass: the prompt's rows go through every product anyway.
        together = self.batched and len(sequences) > 1 and (any(joining) or self._choice.together(len(sequences)))
        start = time.perf_counter()
        if together:
            logits = self.engine.forward_batch(blocks, [s.caches for s in sequences])
        else:
            logits = [self._last_logits(block, s.caches) for block, s in zip(blocks, sequences)]
        elapsed = time.perf_counter() - start
        if decoding:
            self._choice.record(len(sequences), together, elapsed)
        self.counters.steps += 1
        self.counters.tokens += len(sequences)
        self.counters.prompt_tokens += sum(len(s.unread) for s in sequences)
        self.counters.seconds += elapsed
        self.counters.batched += together
        for sequence, row, joined in zip(sequences, logits, joining):
            if joined:  # it waited for the whole step, as the others did
                sequence.stats.prompt_seconds, sequence.unread = elapsed, sequence.unread[:0]
            else:
                sequence.stats.decode_steps += 1
                sequence.stats.generation_seconds += elapsed
            sequence.tokens.append(sequence.generation.next_token(row))

    def finish(self, sequence: Sequence) -> None:
        """``sequence`` leaves the batch (finished, or given up): its statistics completed, its caches kept for a
        later prompt that begins as its text does."""
        g, stats = sequence.generation, sequence.stats
        stats.generated_tokens = g.sampled
        stats.stopped_at_window, stats.stopped_at_eos = g.stopped_at_window, g.stopped_at_token
        if self.prompt_cache is not None and not len(sequence.unread):  # (its caches hold what it read)
            self.prompt_cache.keep(sequence.prompt + sequence.tokens, sequence.caches)

    def _last_logits(self, tokens: np.ndarray, caches) -> np.ndarray:
        if self.batched:  # the output head for the last token only
            return self.engine.forward(tokens, caches, all_logits=False)[-1]
        return self.engine.forward(tokens, caches)[-1]
