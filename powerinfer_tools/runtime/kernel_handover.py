"""A generation begun on the NumPy reference kernels, moved onto the compiled ones between two of its steps as soon
as a background build has made them.

The first ``pitools run`` of a kind of model on a machine starts at once on the reference while another process
builds the compiled kernels (``runtime.warmup``, policy ``background``). On a real model a reference step is slow
(it dequantizes every matrix it multiplies by, a vocabulary's output head included, at every token), so a run that
kept to it would end long after the build. Instead, before each step the generation looks at the build's marker;
the first time the kernels are ready, this process turns to them (``kernels.use_reference(None)``) and the next step
is compiled. The model carries on as it is: its KV cache (float32 keys and values, whichever kernels computed them),
and the layouts it was loaded in (a q4_0 matrix that a compiled load would have interleaved stays as stored, for
this process). The tokens after the move are computed as a compiled run computes them, on the keys and values the
reference computed, which agree with the compiled ones within the tolerance between the two paths; a greedy text
can still part from a compiled run's where two tokens' logits lie closer than that.

So the run ends about when the build does, late by at most the reference step under way at that moment, provided
its steps leave the build its core. Where they would not, the run waits for the build instead, as the ``wait``
policy does (in process, where no build is under way yet: a build in another process starts later and opens the
model again). From the start where ``reason_to_wait`` says so: fewer than ``CORES_NEEDED`` idle cores (by the threads
running now: the reference's steps would take the build's core), or a model whose weights pass
``REFERENCE_WEIGHT_BYTES``, whose every step on the reference takes seconds. Else between two steps, once the
reference's tokens show it (``stepping_pays``): a token that took longer than ``SLOW_STEP_SECONDS``, or tokens that
spent their time waiting for a core more than computing (``CONTENDED``: a machine that became busy, where every
step on the reference delays the build it waits for). (A prompt's step is not judged: it also pages the model in,
and computes many tokens.) Until the move the reference's own BLAS products run on one thread, leaving the other
cores to the build, which compiles on one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

from powerinfer_tools import kernels
from powerinfer_tools.formats.model_file import ModelFile
from powerinfer_tools.runtime.backends import single_threaded_blas
from powerinfer_tools.units import format_size

CORES_NEEDED = 2  # idle, to start on the reference beside the build: one for the build, one for the run
SLOW_STEP_SECONDS = 2.0  # a token slower than this on the reference, and the generation waits for the build instead
# The reference's tokens' wall time over their CPU time beyond which they are taken to wait for a core (judged once
# they add up to JUDGED_AFTER_SECONDS): the build then waits for one too, and the generation waits for the build.
CONTENDED = 1.25
JUDGED_AFTER_SECONDS = 1.0
# A model's weights beyond which a token on the reference takes about SLOW_STEP_SECONDS or more, as measured on
# Gemma 3 and SmolLM2 (docs/lab/kernels.md, "First-call cost"): such a model waits for the build from the start.
REFERENCE_WEIGHT_BYTES = 10**9


def reason_to_wait(model_file: ModelFile) -> str | None:
    """Why a run of ``model_file`` should wait for the compiled kernels rather than start on the reference while
    they are built, in a few words; None where starting pays."""
    idle = kernels.idle_cores()
    if idle < CORES_NEEDED - 0.5:  # (the slack of commands.options' choice of OpenMP's wait policy)
        return (f"{max(idle, 0):.1f} of this machine's {os.cpu_count() or 1} cores are idle, and the NumPy kernels "
                "beside the build would slow it")
    weights = sum(t.nbytes for t in model_file.tensors.values())
    if weights > REFERENCE_WEIGHT_BYTES:
        return f"a model of {format_size(weights)} takes seconds a token on the NumPy kernels"
    return None


@dataclass(frozen=True)
class Handover:
    """How a generation came onto the compiled kernels."""

    reference_steps: int  # steps computed on the reference before the move (the prompt's first)
    waited: bool  # it stopped stepping on the reference (``stepping_pays``) and waited for the build


@dataclass
class ReferenceTokens:
    """What the one-token steps on the reference took: the last one's wall time, and all of theirs, wall and CPU."""

    last: float = 0.0
    wall: float = 0.0
    cpu: float = 0.0

    def add(self, wall: float, cpu: float) -> None:
        self.last = wall
        self.wall += wall
        self.cpu += cpu

    def stepping_pays(self) -> bool:
        """Whether another step on the reference beside the build can end the run sooner than waiting for it."""
        if self.last > SLOW_STEP_SECONDS:
            return False  # the build may end just after such a step begins
        return self.wall < JUDGED_AFTER_SECONDS or self.wall <= CONTENDED * self.cpu


def handing_over(step, build, moved: Callable[[Handover], None]):
    """``step`` (a generation's ``generation.StepFn`` on a model that runs on the reference while ``build``, a
    ``warmup.BackgroundBuild``, makes the compiled kernels), moved onto them before the first step that finds them
    ready, waiting for them instead of stepping once that no longer pays; ``moved`` is told how, once. A build that
    ends without them leaves the generation on the reference."""
    tokens_taken, taken, on_reference = ReferenceTokens(), 0, True

    def step_or_move(tokens):
        nonlocal taken, on_reference
        if on_reference:
            ready = build.ready()
            waited = not ready and not tokens_taken.stepping_pays() and build.wait()
            if ready or waited:
                kernels.use_reference(None)
                on_reference = False
                moved(Handover(taken, waited))
        if not on_reference:
            return step(tokens)
        wall, cpu = time.perf_counter(), time.process_time()
        with single_threaded_blas():
            logits = step(tokens)
        taken += 1
        if len(tokens) == 1:
            tokens_taken.add(time.perf_counter() - wall, time.process_time() - cpu)
        return logits

    return step_or_move
