"""``--ray [ADDRESS]`` as the pipeline sees it: the ``interfaces.Workers`` that train predictors and
profile windows on a Ray cluster, or None without ``--ray`` (everything runs in this process)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from powerinfer_tools.cluster.ray_profiling import RayWindows
from powerinfer_tools.cluster.ray_session import ray_cluster
from powerinfer_tools.cluster.ray_training import RayCandidates
from powerinfer_tools.interfaces import Workers


@contextmanager
def ray_workers(address: str | None) -> Iterator[Workers | None]:
    with ray_cluster(address) as cluster:
        yield None if cluster is None else Workers(RayCandidates(cluster), RayWindows(cluster))
