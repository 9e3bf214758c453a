"""Requests share the one model: up to ``parallel`` generations decoded together (continuous batching:
``runtime.batching``), more waiting in a bounded first-come-first-served queue.

One thread (``pitools-batch``) runs the model: between two steps it drops the generations whose clients have
gone, starts those waiting while slots are free, then computes, in one forward pass, every running generation's
next token and the prompts of those starting (beyond what the prompt cache holds). Each generation's text
(stop strings cut) travels back to the event loop as it is produced, as do its start and end, so that the
counts of requests waiting and running change on the event loop only.

A place in the queue is taken at admission (``admit``), before the request's prompt is rendered and
tokenized and before any response starts, so that ``max_queue`` bounds that work too and a full queue
can still answer 503. A request whose client has gone sets its job's ``cancelled`` flag; the batch thread
checks it before every step, so a disconnected stream frees its slot within one token. At shutdown
(``shut_down``) the running generations are cancelled the same way and every request still holding a
place ends with ShuttingDown, so that a stream can tell its client why it ends.
"""

from __future__ import annotations

import asyncio
import collections
import math
import threading
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional

from powerinfer_tools.runtime.batching import DEFAULT_PARALLEL, BatchDecoder, Sequence
from powerinfer_tools.runtime.engine import RuntimeModel
from powerinfer_tools.runtime.generation import SamplingConfig, TextPieces
from powerinfer_tools.runtime.llm import LLM, GenerationStats
from powerinfer_tools.runtime.prompt_cache import PromptCache
from powerinfer_tools.serving.metrics import ServerMetrics
from powerinfer_tools.serving.stop_strings import StopStrings

class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"the server's queue is full; retry in {retry_after} s")
        self.retry_after = retry_after


class ShuttingDown(Exception):
    def __init__(self):
        super().__init__("the server is shutting down; send the request again once it is back (or to another)")


@dataclass
class Job:
    """One generation: what to run, and (once the batch thread is done with it) how it ended."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingConfig
    stops: list[str]
    cancelled: threading.Event = field(default_factory=threading.Event)
    finish_reason: Optional[str] = None  # "stop" (EOS or a stop string), "length"; None if cancelled
    stats: GenerationStats = field(default_factory=GenerationStats)
    post: Callable[[object], None] = print  # on the batch thread: hands a message to the request (``Scheduler.run``)
    running: bool = False  # it has a slot (on the event loop: ``Scheduler._deliver``)


_STARTED = object()  # the batch thread's messages to a request: it has a slot ...


@dataclass
class _Ended:  # ... and it has ended (with the exception that ended it, if one did)
    error: Optional[BaseException] = None


class Ticket:
    """A place in the queue, held from admission until the job gets a slot (or never will)."""

    def __init__(self, scheduler: "Scheduler"):
        self._scheduler, self.waiting = scheduler, True

    def leave(self) -> None:
        """Give the place up; once only, whoever calls first."""
        if self.waiting:
            self.waiting = False
            self._scheduler.waiting -= 1


@dataclass
class _Running:
    """A job with a slot: its sequence in the batch, and its text on the way out."""

    job: Job
    sequence: Sequence
    pieces: TextPieces
    stops: StopStrings


class Scheduler:
    def __init__(self, llm: LLM, max_queue: int, metrics: ServerMetrics, parallel: int = DEFAULT_PARALLEL,
                 prompt_cache_bytes: int = 0):
        self.llm, self.max_queue, self.metrics, self.parallel = llm, max_queue, metrics, parallel
        self.waiting = 0  # admitted, not yet running (its prompt being prepared, or queued)
        self.running = 0
        self.closing = False
        self.decoder = BatchDecoder(llm, PromptCache(prompt_cache_bytes) if prompt_cache_bytes else None)
        if isinstance(llm.engine, RuntimeModel):
            llm.engine.stats = metrics.ffn  # every step's neurons and bytes, whichever sequences it ran
        self._queue: collections.deque[Job] = collections.deque()
        self._wake = threading.Condition()
        self._stopped = False
        self._running: list[_Running] = []  # the batch thread's; replaced, never changed in place (shut_down reads it)
        self._thread = threading.Thread(target=self._decode, name="pitools-batch", daemon=True)
        self._thread.start()

    def admit(self) -> Ticket:
        """A place in the queue, or QueueFull with a guess of when to retry (ShuttingDown once stopping)."""
        if self.closing:
            raise ShuttingDown()
        if self.waiting + self.running >= self.parallel + self.max_queue:  # every slot taken, max_queue behind
            per_request = self.metrics.mean_request_seconds() or 1.0
            raise QueueFull(max(1, math.ceil(per_request * (self.waiting + self.running) / self.parallel)))
        self.waiting += 1
        return Ticket(self)

    async def run(self, job: Job, ticket: Ticket) -> AsyncIterator[str]:
        """The job's text as it is generated, once it has a slot; ``job.finish_reason`` is set at the end.
        Leaving early (the consumer cancelled or closed) stops the generation before its next token."""
        if self.closing:
            ticket.leave()
            raise ShuttingDown()
        loop = asyncio.get_running_loop()
        messages: asyncio.Queue = asyncio.Queue()
        job.post = lambda message: loop.call_soon_threadsafe(self._deliver, job, ticket, messages, message)
        with self._wake:
            self._queue.append(job)
            self._wake.notify()
        try:
            while not isinstance(message := await messages.get(), _Ended):
                if message is not _STARTED:
                    yield message
        finally:
            job.cancelled.set()  # a no-op once it ended; else its slot is given up before the next step
            ticket.leave()
        if message.error is not None:
            raise message.error
        if job.finish_reason is None and self.closing:  # cut short by shut_down
            raise ShuttingDown()

    def _deliver(self, job: Job, ticket: Ticket, messages: asyncio.Queue, message) -> None:
        """On the event loop: a message of the batch thread about ``job``, counted, then handed to its request
        (if it still listens)."""
        if message is _STARTED:
            ticket.leave()
            job.running = True
            self.running += 1
        elif isinstance(message, _Ended) and job.running:  # (one cancelled while queued never ran)
            job.running = False
            self.running -= 1
            self.metrics.record_generation(job.stats, cancelled=job.finish_reason is None)
        messages.put_nowait(message)

    # -- the batch thread --------------------------------------------------------

    def _decode(self) -> None:
        """The batch thread: start waiting jobs while slots are free, then step every running one, until closed."""
        while True:
            with self._wake:
                while not self._queue and not self._running and not self._stopped:
                    self._wake.wait()
                if self._stopped:
                    break
                free = self.parallel - len(self._running)
                starting = [self._queue.popleft() for _ in range(min(len(self._queue), free))]
            self._running = self._running + [r for r in map(self._start, starting) if r is not None]
            self._running = [r for r in self._running if not self._ended(r)]
            if self._running:
                self._running = self._step(self._running)
        for r in self._running:
            r.job.post(_Ended(ShuttingDown()))

    def _start(self, job: Job) -> Optional[_Running]:
        """``job`` in a slot, its sequence to join the next step (which computes its prompt); None where it ended
        already (cancelled, the server stopping, nothing to generate)."""
        if job.cancelled.is_set() or self.closing:
            job.post(_Ended(ShuttingDown() if self.closing else None))
            return None
        job.post(_STARTED)
        try:
            sequence = self.decoder.start(job.prompt_ids, job.max_tokens, job.sampling)
        except Exception as exc:  # (its prompt cache's copy): its request answers so, the others go on
            job.post(_Ended(exc))
            return None
        job.stats = sequence.stats
        running = _Running(job, sequence, TextPieces(self.llm.tokenizer.decode), StopStrings(job.stops))
        return None if self._ended(running) else running

    def _step(self, running: list[_Running]) -> list[_Running]:
        """One step of every running job; those still running after it (none where the model failed)."""
        try:
            self.decoder.step([r.sequence for r in running])
        except Exception as exc:  # every generation of the step fails alike
            for r in running:
                r.job.cancelled.set()
                r.job.post(_Ended(exc))
            return []
        for r in running:
            self._take(r)
        return running

    def _take(self, r: _Running) -> None:
        """The text of ``r``'s newest token (stop strings cut) to its request; at its end, what was held back."""
        if not r.sequence.tokens or r.stops.stopped:
            return
        text = r.pieces.feed(r.sequence.tokens[-1])
        if r.sequence.finished:
            text += r.pieces.flush()
        if text and (out := r.stops.feed(text)):
            r.job.post(out)
        if r.sequence.finished and not r.stops.stopped and (rest := r.stops.flush()):
            r.job.post(rest)

    def _ended(self, r: _Running) -> bool:
        """Whether ``r`` has ended (finished, a stop string, its client gone): then its slot is given back, its
        ending posted."""
        job = r.job
        if self.closing and not (r.sequence.finished or r.stops.stopped):  # (one starting when shut_down came)
            job.cancelled.set()
        if not (r.sequence.finished or r.stops.stopped or job.cancelled.is_set()):
            return False
        self.decoder.finish(r.sequence)
        if not job.cancelled.is_set():
            job.finish_reason = "stop" if r.stops.stopped or job.stats.stopped_at_eos else "length"
        job.post(_Ended())
        return True

    # -- stopping ----------------------------------------------------------------

    def shut_down(self) -> None:
        """The server is stopping: refuse new requests, stop the running generations before their next token
        rather than let them finish, and end those waiting before they start."""
        self.closing = True
        with self._wake:
            for job in [r.job for r in self._running] + list(self._queue):
                job.cancelled.set()
            self._wake.notify()

    def close(self) -> None:
        """Once the server has stopped serving: no generation runs any more."""
        self.shut_down()
        with self._wake:
            self._stopped = True
            self._wake.notify()
