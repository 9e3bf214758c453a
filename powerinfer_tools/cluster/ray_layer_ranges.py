"""Profiling a model larger than one node's memory on a Ray cluster (``--ray ADDRESS --layer-ranges N``):
the layers cut into N ranges of consecutive layers, each held by a Ray actor of its own, and every
window passed through them in turn, the residual stream handed from range to range.

Each actor reads only its range's blocks (and the embeddings and output head, which every range
holds: 2 GB of a 70B model's 280 GB in float32) from the checkpoint folder at the same path on its
own node: shared storage, or a copy on each node. The model never passes through the driver or the
object store; what moves is a window's residual stream (``seq_len · d_model`` float32: 8 MB at 256
tokens of a 70B's 8,192 widths) from one range to the next, and each range's recording back to the
driver. A window's recording, per layer, is what ``profiler.record_window`` records in one process
(the same operations on the same stream), so the profile folder is the same byte for byte.

Ranges run as a pipeline: while range 2 runs window w, range 1 runs window w+1. The actors are
spread over the nodes (Ray's SPREAD strategy); each takes one CPU for as long as the command runs,
so the cluster needs at least N CPUs.

Faults: an actor whose process or node dies is restarted (reading its range again) and its calls
retried, ``MAX_RETRIES`` times; a window that still fails ends the command with one line naming it
and its range, and the profile folder keeps its last checkpoint, from which the same command resumes.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.cluster.ray_session import RayCluster, crash_if_asked
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.interfaces import FFNTracer
from powerinfer_tools.models import load_model
from powerinfer_tools.profiling.profiler import WindowJob, WindowRecording, record_layers

# Windows under way per range: one running in each range, one waiting at its door.
WINDOWS_PER_RANGE = 2


def layer_ranges(n_layers: int, count: int) -> list[range]:
    """``n_layers`` cut into ``count`` ranges of consecutive layers, the first ones a layer longer when
    they do not divide evenly."""
    if count > n_layers:
        raise PitoolsError(f"--layer-ranges {count}: the model has only {n_layers} layers")
    bounds = [round(i * n_layers / count) for i in range(count + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


class LayerRange:
    """A Ray actor: one range of the model's layers, read from the checkpoint folder on its node."""

    def __init__(self, folder: str, layers: range):
        self.layers = layers
        try:
            self.model, self.error = load_model(Checkpoint(folder), layers=layers), None
        except PitoolsError as exc:  # told with the first window it is asked to run, as one line
            self.model, self.error = None, PitoolsError(
                f"{exc} (on {socket.gethostname()}; every node needs the checkpoint at the same path)")

    def record(self, job: WindowJob, entering: np.ndarray | None) -> tuple[WindowRecording, np.ndarray]:
        if self.error is not None:
            raise self.error
        crash_if_asked(f"layers-{self.layers.start}-window-{job.index}")
        return record_layers(self.model, job, self.layers, entering)


class RayLayerRanges:
    """``profiler.WindowRecorder`` on a Ray cluster, an actor per range of layers (``layer_ranges``): each
    window's recording merged from its ranges' and yielded in order."""

    def __init__(self, cluster: RayCluster, checkpoint: Path, ranges: list[range]):
        cpus = cluster.ray.cluster_resources().get("CPU", 0)
        if cpus < len(ranges):
            raise PitoolsError(f"--layer-ranges {len(ranges)} needs a CPU per range; the Ray cluster has {cpus:g}")
        self._cluster, self._checkpoint, self._ranges = cluster, checkpoint, ranges

    def record(self, model: FFNTracer, jobs: list[WindowJob]) -> Iterator[WindowRecording]:
        if not jobs:
            return
        actor = self._cluster.actor(LayerRange)
        actors = [actor.remote(str(self._checkpoint.resolve()), layers) for layers in self._ranges]
        for job, parts in self._cluster.in_order(jobs, partial(self._submit, actors), WINDOWS_PER_RANGE * len(actors)):
            yield self._merged(job, parts)

    @staticmethod
    def _submit(actors: list, job: WindowJob) -> list:
        """The window through every range, each passed the stream the range before it leaves (a Ray
        reference: it goes from actor to actor, not through the driver); each range's recording."""
        stream, parts = None, []
        for actor in actors:
            part, stream = actor.record.options(num_returns=2).remote(job, stream)
            parts.append(part)
        return parts

    def _merged(self, job: WindowJob, parts: list) -> WindowRecording:
        end = job.start + len(job.tokens)
        recordings = []
        for layers, part in zip(self._ranges, parts):
            span = f"layer {layers.start}" if len(layers) == 1 else f"layers {layers.start}-{layers.stop - 1}"
            what = f"profiling window {job.index} (tokens {job.start}-{end - 1}) on {span}"
            recordings.append(self._cluster.result(part, what))
        for later in recordings[1:]:
            recordings[0].add(later)
        return recordings[0]
