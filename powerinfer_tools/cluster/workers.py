"""``--ray [ADDRESS]`` as the pipeline sees it: the ``interfaces.Workers`` that train predictors and
profile windows on a Ray cluster, or None without ``--ray`` (everything runs in this process)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from powerinfer_tools.cluster.ray_layer_ranges import RayLayerRanges
from powerinfer_tools.cluster.ray_profiling import RayWindows
from powerinfer_tools.cluster.ray_session import ray_cluster
from powerinfer_tools.cluster.ray_training import RayCandidates
from powerinfer_tools.interfaces import Workers


@contextmanager
def ray_workers(address: str | None, layer_ranges: list[range] | None = None,
                checkpoint: Path | None = None) -> Iterator[Workers | None]:
    """With ``layer_ranges``, windows are profiled by an actor per range, each holding those layers of
    ``checkpoint`` (``ray_layer_ranges``); else by a task per window holding the whole model."""
    with ray_cluster(address) as cluster:
        if cluster is None:
            yield None
            return
        windows = RayWindows(cluster) if layer_ranges is None else RayLayerRanges(cluster, checkpoint, layer_ranges)
        yield Workers(RayCandidates(cluster), windows)
