"""Profiling on a Ray cluster (``--ray [ADDRESS]``): a Ray task per window of the calibration text,
with the same profile folder as profiling here.

A window is an independent forward pass (a fresh KV cache, ``profiler.record_window``): its
firing counts, absolute sums and sampled training pairs are a pure function of the model and its
tokens. So each window is recorded in a task of its own, anywhere, and the driver adds the
recordings to the profile in corpus order, as profiling here does: the same sums in the same order
(the absolute sums are float64: added in another order they would differ in their last bits),
the same checkpoints, the same resume.

Data: the model (the reference engine's weights, float32) goes into Ray's object store once per
command and Ray moves it to each node once; a task reads a window's tokens (``seq_len`` ids) and
returns its recording: per layer a count and a float64 sum per neuron, and its sampled pairs
(float16 inputs, fired bits), ~16·n_layers·d_ff bytes plus the pairs, 2 MB a window at TinyLlama's
widths. About two windows per cluster CPU are under way at a time (``ray_session.TASKS_PER_CPU``),
so the driver holds that many recordings, not the profile. The nodes share no file system: only the
driver reads the corpus and writes the profile folder. Each node needs memory for the whole model;
for a model larger than one node, ``ray_layer_ranges`` gives each node a range of its layers.

Faults: as for training (``ray_session``): a lost worker is retried; a window that raises or is lost
on every attempt ends the command with one line naming it, and the folder keeps its last checkpoint,
from which the same command resumes.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

from powerinfer_tools.cluster.ray_session import RayCluster, crash_if_asked
from powerinfer_tools.interfaces import FFNTracer
from powerinfer_tools.profiling.profiler import WindowJob, WindowRecording, record_window


class RayWindows:
    """``profiler.WindowRecorder`` on a Ray cluster: a task per window, recordings yielded in order."""

    def __init__(self, cluster: RayCluster):
        self._cluster = cluster
        self._task = cluster.task(record_window_task)

    def record(self, model: FFNTracer, jobs: list[WindowJob]) -> Iterator[WindowRecording]:
        if not jobs:
            return
        model_ref = self._cluster.ray.put(model)  # once: every task reads this copy (moved once per node)
        submit = partial(self._task.remote, model_ref)
        for job, task in self._cluster.in_order(jobs, submit, self._cluster.tasks_in_flight()):
            end = job.start + len(job.tokens)
            yield self._cluster.result(task, f"profiling window {job.index} (tokens {job.start}-{end - 1})")


def record_window_task(model: FFNTracer, job: WindowJob) -> WindowRecording:
    """A Ray task: one window's recording."""
    crash_if_asked(f"window-{job.index}")
    return record_window(model, job)
