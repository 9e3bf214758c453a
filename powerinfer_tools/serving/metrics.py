"""What the server has done, for ``GET /metrics`` in Prometheus' text format.

Counters only grow (a scraper takes rates of them); the gauges are the queue and the slots now and ratios
over everything generated so far: tokens per second of generation (each generation's, and the batches'), the
mean batch, the mean fraction of FFN neurons computed, and under ``--ram`` the neuron caches' hit rate.
"""

from __future__ import annotations

import math
from collections import Counter

from powerinfer_tools.runtime.batching import BatchDecoder
from powerinfer_tools.runtime.engine import TokenStats
from powerinfer_tools.runtime.llm import GenerationStats

PREFIX = "pitools"


class ServerMetrics:
    def __init__(self, ram_budget: bool):
        self.ram_budget = ram_budget  # whether the neuron caches' figures mean anything
        self.responses: Counter = Counter()  # (route, HTTP status) -> responses
        self.prompt_tokens = self.completion_tokens = self.decode_steps = self.generations = self.cancelled = 0
        self.prompt_reused = 0
        self.prompt_seconds = self.generation_seconds = 0.0
        self.ffn = TokenStats()  # the runtime's steps add to it (``Scheduler``): neurons and bytes per token

    def record_response(self, route: str, status: int) -> None:
        self.responses[route, status] += 1

    def record_generation(self, stats: GenerationStats, cancelled: bool) -> None:
        self.generations += 1
        self.cancelled += cancelled
        self.prompt_tokens += stats.prompt_tokens
        self.prompt_reused += stats.prompt_reused
        self.completion_tokens += stats.generated_tokens
        self.decode_steps += stats.decode_steps
        self.prompt_seconds += stats.prompt_seconds
        self.generation_seconds += stats.generation_seconds

    def mean_request_seconds(self) -> float | None:
        """A generation's mean time on the model so far (None before the first)."""
        if not self.generations:
            return None
        return (self.prompt_seconds + self.generation_seconds) / self.generations

    def exposition(self, waiting: int, running: int, slots: int, batches: BatchDecoder) -> str:
        rate = self.decode_steps / self.generation_seconds if self.generation_seconds else 0.0
        steps = batches.counters
        lines: list[str] = []

        def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP {PREFIX}_{name} {help}", f"# TYPE {PREFIX}_{name} {kind}"])
            lines.extend(f"{PREFIX}_{name}{labels} {_number(value)}" for labels, value in samples)

        metric("responses_total", "counter", "HTTP responses by route and status.",
               [(f'{{route="{route}",status="{status}"}}', n) for (route, status), n in sorted(self.responses.items())])
        metric("generations_total", "counter", "Generations run on the model.", [("", self.generations)])
        metric("generations_cancelled_total", "counter", "Generations stopped because the client went away.",
               [("", self.cancelled)])
        metric("prompt_tokens_total", "counter", "Prompt tokens of the generations (computed or reused).",
               [("", self.prompt_tokens)])
        metric("prompt_tokens_reused_total", "counter", "Prompt tokens whose keys and values the prompt cache held "
               "(not computed).", [("", self.prompt_reused)])
        cache = batches.prompt_cache
        metric("prompt_cache_hits_total", "counter", "Prompts that began with tokens the prompt cache held.",
               [("", cache.hits if cache is not None else 0)])
        metric("prompt_cache_bytes", "gauge", "Memory the prompt cache holds (--prompt-cache bounds it).",
               [("", cache.nbytes if cache is not None else 0)])
        metric("completion_tokens_total", "counter", "Tokens generated.", [("", self.completion_tokens)])
        metric("prompt_seconds_total", "counter", "Seconds spent on prompts' forward passes.",
               [("", self.prompt_seconds)])
        metric("generation_seconds_total", "counter", "Seconds the generations spent in decoding steps, summed over "
               "generations (those decoded together each count the whole step).", [("", self.generation_seconds)])
        metric("generation_tokens_per_second", "gauge", "Tokens per second of one generation (its decoding steps), "
               "over all requests.", [("", rate)])
        metric("batch_steps_total", "counter", "Decoding steps: one forward pass over every running generation's next "
               "token and the prompts of those joining.", [("", steps.steps)])
        metric("batch_tokens_total", "counter", "Tokens those steps decoded (a step decodes one per generation).",
               [("", steps.tokens)])
        metric("batch_prompt_tokens_total", "counter", "Prompt tokens those steps computed (of generations joining).",
               [("", steps.prompt_tokens)])
        metric("batch_seconds_total", "counter", "Seconds spent in decoding steps.", [("", steps.seconds)])
        metric("batch_steps_together_total", "counter", "Decoding steps of several generations computed as one "
               "forward pass (the others: a compiled pass per generation, where that measured faster).",
               [("", steps.batched)])
        metric("batch_size_mean", "gauge", "Generations decoded together per step, on average (NaN before any).",
               [("", steps.tokens / steps.steps if steps.steps else float("nan"))])
        metric("batch_tokens_per_second", "gauge", "Tokens per second the decoding steps produced, all generations "
               "together.", [("", steps.tokens / steps.seconds if steps.seconds else 0.0)])
        metric("queue_length", "gauge", "Requests admitted and waiting for a slot (their prompt being prepared, "
               "or queued).", [("", waiting)])
        metric("requests_running", "gauge", "Requests generating now.", [("", running)])
        metric("slots", "gauge", "Generations that may run together (--parallel).", [("", slots)])
        metric("ffn_density", "gauge", "Mean fraction of FFN neurons computed per token (NaN before any).",
               [("", self.ffn.density)])
        if self.ram_budget:
            metric("neuron_cache_hit_rate", "gauge", "Share of cold neurons found in the neuron caches (--ram).",
                   [("", self.ffn.hit_rate)])
            metric("disk_bytes_total", "counter", "Bytes of weights read from disk (--ram).", [("", self.ffn.disk_bytes)])
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    return repr(value) if isinstance(value, float) else str(value)
