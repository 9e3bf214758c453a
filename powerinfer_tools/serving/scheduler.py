"""Requests take turns on the one model: a bounded first-come-first-served queue, one generation at a time.

Why not batch decoding: on the CPU a sparse runtime's token costs about what its active rows cost to
read, and two sequences' active neurons mostly differ, so a batch reads nearly the union of both: measured,
one pass over 4-16 tokens gains at most ~1.3x over as many one-token passes (docs/serving.md). Generations run one at a time on one worker thread (the model
and its compiled kernels are not re-entrant; the kernels use every core already), and each request's
pieces of text travel back to the event loop as they are produced.

A place in the queue is taken at admission (``admit``), before the request's prompt is rendered and
tokenized and before any response starts, so that ``max_queue`` bounds that work too and a full queue
can still answer 503. A request whose client has gone sets its job's ``cancelled`` flag; the worker
checks it before every token, so a disconnected stream frees the model within one token. At shutdown
(``shut_down``) the running generation is cancelled the same way and every request still holding a
place ends with ShuttingDown, so that a stream can tell its client why it ends.
"""

from __future__ import annotations

import asyncio
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional

from powerinfer_tools.runtime.generation import SamplingConfig
from powerinfer_tools.runtime.llm import LLM, GenerationStats
from powerinfer_tools.serving.metrics import ServerMetrics
from powerinfer_tools.serving.stop_strings import StopStrings

_END = object()  # the worker's last message to the event loop


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"the server's queue is full; retry in {retry_after} s")
        self.retry_after = retry_after


class ShuttingDown(Exception):
    def __init__(self):
        super().__init__("the server is shutting down; send the request again once it is back (or to another)")


@dataclass
class Job:
    """One generation: what to run, and (once the worker is done) how it ended."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingConfig
    stops: list[str]
    cancelled: threading.Event = field(default_factory=threading.Event)
    finish_reason: Optional[str] = None  # "stop" (EOS or a stop string), "length"; None if cancelled
    stats: GenerationStats = field(default_factory=GenerationStats)


class Ticket:
    """A place in the queue, held from admission until the job gets the model (or never will)."""

    def __init__(self, scheduler: "Scheduler"):
        self._scheduler, self.waiting = scheduler, True

    def leave(self) -> None:
        """Give the place up; once only, whoever calls first."""
        if self.waiting:
            self.waiting = False
            self._scheduler.waiting -= 1


class Scheduler:
    def __init__(self, llm: LLM, max_queue: int, metrics: ServerMetrics):
        self.llm, self.max_queue, self.metrics = llm, max_queue, metrics
        self.waiting = 0  # admitted, not yet running (its prompt being prepared, or queued)
        self.running = 0
        self.closing = False
        self._current: Optional[Job] = None  # the job on the model
        self._slot = asyncio.Lock()  # FIFO: waiters get it in the order they asked
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="pitools-generate")

    def admit(self) -> Ticket:
        """A place in the queue, or QueueFull with a guess of when to retry (ShuttingDown once stopping)."""
        if self.closing:
            raise ShuttingDown()
        if self.waiting + self.running > self.max_queue:  # one on the model, max_queue behind it
            per_request = self.metrics.mean_request_seconds() or 1.0
            raise QueueFull(max(1, math.ceil(per_request * (self.waiting + self.running))))
        self.waiting += 1
        return Ticket(self)

    async def run(self, job: Job, ticket: Ticket) -> AsyncIterator[str]:
        """The job's text as it is generated, once its turn comes; ``job.finish_reason`` is set at the end.
        Leaving early (the consumer cancelled or closed) stops the generation at the next token."""
        try:
            await self._slot.acquire()
        finally:
            ticket.leave()
        if self.closing:  # its turn came after the server began to stop
            self._slot.release()
            raise ShuttingDown()
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()
        self.running += 1
        self._current = job
        future = loop.run_in_executor(self._worker, self._generate, job,
                                      lambda item: loop.call_soon_threadsafe(pieces.put_nowait, item))
        future.add_done_callback(lambda _: self._finished(job))
        try:
            while (item := await pieces.get()) is not _END:
                yield item
            await future  # the worker's exception, if it raised one
        finally:
            job.cancelled.set()
        if job.finish_reason is None and self.closing:  # cut short by shut_down
            raise ShuttingDown()

    def _finished(self, job: Job) -> None:
        """On the event loop once the worker has let go of the model: the next job may start."""
        self.running -= 1
        self._current = None
        self._slot.release()
        self.metrics.record_generation(job.stats, cancelled=job.finish_reason is None)

    def _generate(self, job: Job, emit: Callable[[object], None]) -> None:
        """On the worker thread: run the model, sending text pieces (stop strings cut) through ``emit``."""
        try:
            pieces = self.llm.generate(job.prompt_ids, job.max_tokens, job.sampling)
            job.stats = self.llm.last_stats
            stops = StopStrings(job.stops)
            for piece in pieces:
                if job.cancelled.is_set():
                    break
                if text := stops.feed(piece):
                    emit(text)
                if stops.stopped:
                    break
            else:
                if text := stops.flush():
                    emit(text)
            pieces.close()  # ends the generation (and completes its stats) when we left the loop early
            if not job.cancelled.is_set():
                job.finish_reason = "stop" if stops.stopped or job.stats.stopped_at_eos else "length"
        finally:
            emit(_END)

    def shut_down(self) -> None:
        """The server is stopping: refuse new requests, stop the running generation at its next token
        rather than let it finish, and end those waiting before they start."""
        self.closing = True
        if self._current is not None:
            self._current.cancelled.set()

    def close(self) -> None:
        """Once the server has stopped serving: no generation runs any more."""
        self.shut_down()
        self._worker.shutdown(wait=False, cancel_futures=True)
