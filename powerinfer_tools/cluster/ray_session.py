"""Joining a Ray cluster for ``--ray [ADDRESS]``, and what our tasks on it share: one CPU and one
BLAS thread each, retries of lost workers, one error line for a task that fails, a progress note
while the driver waits.

Two kinds of work run there: predictor training, a task per FFN unit (``ray_training``), and
profiling, a task per window of the calibration text (``ray_profiling``) or, for a model larger than
a node, an actor per range of layers (``ray_layer_ranges``). ``ray_workers`` hands them to the
pipeline as an ``interfaces.Workers``.
"""

from __future__ import annotations

import logging
import os
import socket
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from powerinfer_tools.errors import PitoolsError, install_hint

# A lost worker or node is retried this many times; a Python exception in a task is not (it would
# raise again on the same input).
MAX_RETRIES = 3
# Each task runs on one core, its BLAS on one thread: OpenBLAS splits a product's sums differently
# over another number of threads, which changes results' last bits (measured: the predictors of
# tests/test_ray.py's model differ between one and two threads). One thread makes a task's result the same
# on every node of a CPU type, and the same as the command run here with OMP_NUM_THREADS=1.
ONE_THREAD = {"env_vars": {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}}
INSTALL_HINT = f"--ray needs Ray: {install_hint('ray')}"

# While the driver waits for a task, the progress note is refreshed this often.
PROGRESS_SECONDS = 1.0
# Tasks under way per CPU of the cluster: one running, one waiting with its input already moved, so
# that no CPU waits for the driver to read and send the next one's.
TASKS_PER_CPU = 2

# For the fault-tolerance tests (tests/test_ray.py), which start their cluster with this variable
# naming a folder: a task named N (a unit's index, or window-N) that finds the file crash-once-N there
# deletes it and kills its own worker process, so only its first attempt dies; crash-always-N kills
# every attempt.
CRASHES_VARIABLE = "PITOOLS_RAY_TEST_CRASHES"


@contextmanager
def ray_cluster(address: str | None) -> Iterator[RayCluster | None]:
    """None without ``--ray``; else the Ray cluster at ``address`` (``auto``: Ray's own default, the
    cluster in $RAY_ADDRESS or the one ``ray start`` made on this machine, else a Ray instance started
    for this command), left when the block ends."""
    if address is None:
        yield None
        return
    ray = _import_ray()
    if address != "auto":
        _check_reachable(address)
    try:
        ray.init(address=None if address == "auto" else address, logging_level=logging.ERROR, log_to_driver=False)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise PitoolsError(f"--ray {address}: cannot join the Ray cluster: {first_line(exc)}") from None
    try:
        yield RayCluster(ray)
    finally:
        ray.shutdown()


def _import_ray() -> ModuleType:
    try:
        import ray
    except ImportError:
        raise PitoolsError(INSTALL_HINT) from None
    return ray


def _check_reachable(address: str) -> None:
    """Refuse a HOST:PORT where nothing listens: Ray itself retries such an address for minutes."""
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return  # not HOST:PORT: Ray parses it, and refuses what it cannot
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as exc:
        raise PitoolsError(f"--ray {address}: no Ray cluster answers there ({exc.strerror or exc})") from None


class RayCluster:
    """The joined cluster, as our tasks use it."""

    def __init__(self, ray: ModuleType):
        self.ray = ray

    def task(self, function: Callable) -> Any:
        """``function`` as a Ray task on one CPU and one BLAS thread, retried when its worker is lost."""
        return self.ray.remote(num_cpus=1, max_retries=MAX_RETRIES, retry_exceptions=False,
                               runtime_env=ONE_THREAD)(function)

    def actor(self, cls: type) -> Any:
        """``cls`` as a Ray actor on one CPU and one BLAS thread, the actors spread over the nodes, restarted
        when its process is lost and its calls then retried."""
        return self.ray.remote(num_cpus=1, max_restarts=MAX_RETRIES, max_task_retries=MAX_RETRIES,
                               runtime_env=ONE_THREAD, scheduling_strategy="SPREAD")(cls)

    @staticmethod
    def in_order(jobs: list, submit: Callable[[Any], Any], depth: int) -> Iterator[tuple[Any, Any]]:
        """``(job, submit(job))`` for each of ``jobs`` in order, submitting ahead so that ``depth`` jobs are
        under way while the caller waits for the oldest: the cluster busy, results taken in job order."""
        waiting, under_way = deque(jobs), deque()
        while waiting or under_way:
            while waiting and len(under_way) < depth:
                job = waiting.popleft()
                under_way.append((job, submit(job)))
            yield under_way.popleft()

    def tasks_in_flight(self) -> int:
        return max(1, round(TASKS_PER_CPU * self.ray.cluster_resources().get("CPU", 1)))

    def result(self, task: Any, what: str, waiting: Callable[[], None] = lambda: None) -> Any:
        """``task``'s result, calling ``waiting`` every ``PROGRESS_SECONDS`` until it is there; a task that
        raised, or was lost on every attempt, ends the command with one line: "``what`` failed on the Ray
        cluster: why"."""
        exceptions = self.ray.exceptions
        try:
            while not self.ray.wait([task], timeout=PROGRESS_SECONDS)[0]:
                waiting()
            return self.ray.get(task)
        except exceptions.RayTaskError as exc:  # the task raised: its error, not Ray's wrapping of it
            cause = exc.cause if isinstance(exc.cause, Exception) else exc
            message = str(cause) if isinstance(cause, PitoolsError) else f"{type(cause).__name__}: {first_line(cause)}"
        except exceptions.RayError as exc:  # lost: its worker or node died on every attempt, or its data
            message = f"{type(exc).__name__} (a lost worker or node is retried {MAX_RETRIES} times)"
        raise PitoolsError(f"{what} failed on the Ray cluster: {message}")


def crash_if_asked(name: str) -> None:
    """In a task named ``name``: die as the tests asked (``CRASHES_VARIABLE``), else nothing."""
    folder = os.environ.get(CRASHES_VARIABLE)
    if not folder:
        return
    try:
        os.unlink(Path(folder, f"crash-once-{name}"))  # atomic: one attempt alone finds the file
    except FileNotFoundError:
        if not Path(folder, f"crash-always-{name}").exists():
            return
    os._exit(1)


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
