"""Predictor training on a Ray cluster (``--ray [ADDRESS]``): one Ray task per FFN unit (a layer, or
one expert of a mixture), all started at once, with the same choices and output as training here.

The trainer chooses each unit's hidden size in unit order, and a unit's search depends on the
units before it (it starts at the previous unit's size, within what they left of the budget). So
every unit's search runs ahead on a guess (``trainer.UnitJob``: an equal share of the budget, from
the smallest size), each in its own task, and the trainer then makes the real choices in order
here, taking each candidate from those tasks: a candidate is a pure function of (pairs, settings,
seed, unit, size), so it is the same whichever process trained it. A size the real search asks
for that the guess did not try is trained in a task of its own, then waited for. When neighbouring
units choose the same size (the common case) the guess has tried every size the real search needs.

Data: each unit's pairs (float16 inputs and packed fired bits, ``trainer.UnitRows``) are read from
the profile here, on the driver, and put into Ray's object store once, when its task is submitted;
Ray moves them to the node that runs the task. About two tasks per CPU of the cluster are under
way at a time (``TASKS_PER_CPU``), so the store holds that many units' pairs, not the whole
profile. The nodes need no shared file system: only this process reads the profile and writes the
predictor folder. Every node needs pitools (the same version) and Ray installed.

Faults: a task whose worker process or node dies is retried by Ray (``MAX_RETRIES``); a task that
raises, or dies on every attempt, ends the command with one error naming the unit. The predictor
folder holds the units finished before it, written in order (atomically), so the same command
resumes after them.
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

import numpy as np

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.predictors.fit import Fit
from powerinfer_tools.predictors.trainer import (
    LayerPairs,
    TrainSettings,
    UnitJob,
    UnitRows,
    array_module,
    choose_predictor,
    train_candidate,
)

# A lost worker or node is retried this many times; a Python exception in a task is not (it would
# raise again on the same pairs).
MAX_RETRIES = 3
# Each task trains on one core, its BLAS on one thread: OpenBLAS splits a product's sums differently
# over another number of threads, which changes the weights' last bits (measured: the predictors of
# tests/test_ray.py's model differ between one and two threads). One thread makes a task's result the same
# on every node of a CPU type, and the same as `train-predictors` run with OMP_NUM_THREADS=1.
ONE_THREAD = {"env_vars": {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}}
INSTALL_HINT = "--ray needs Ray: pip install 'powerinfer-tools[ray]'"

# While the driver waits for a task, the progress bar shows the units done across the cluster this often.
PROGRESS_SECONDS = 1.0
# Units searching ahead per CPU of the cluster: one running, one waiting with its pairs already
# moved, so that no CPU waits for the driver to read and send the next unit's.
TASKS_PER_CPU = 2

# For the fault-tolerance tests (tests/test_ray.py), which start their cluster with this variable
# naming a folder: a task of unit N that finds the file crash-once-N there deletes it and kills its
# own worker process, so only its first attempt dies; crash-always-N kills every attempt.
CRASHES_VARIABLE = "PITOOLS_RAY_TEST_CRASHES"


@contextmanager
def ray_candidates(address: str | None) -> Iterator[RayCandidates | None]:
    """None without ``--ray``; else candidates trained on the Ray cluster at ``address`` (``auto``: Ray's
    own default, the cluster in $RAY_ADDRESS or the one ``ray start`` made on this machine, else a Ray
    instance started for this command), left when the block ends."""
    if address is None:
        yield None
        return
    ray = _import_ray()
    if address != "auto":
        _check_reachable(address)
    try:
        ray.init(address=None if address == "auto" else address, logging_level=logging.ERROR, log_to_driver=False)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise PitoolsError(f"--ray {address}: cannot join the Ray cluster: {_first_line(exc)}") from None
    try:
        yield RayCandidates(ray)
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


class RayCandidates:
    """``trainer.Candidates`` trained by Ray tasks (the module docstring says how)."""

    def __init__(self, ray: ModuleType):
        self._ray = ray
        options = {"num_cpus": 1, "max_retries": MAX_RETRIES, "retry_exceptions": False, "runtime_env": ONE_THREAD}
        self._search_task = ray.remote(**options)(search_ahead)
        self._fit_task = ray.remote(**options)(fit_one)

    def start(self, jobs: list[UnitJob], settings: TrainSettings, d_ff: int, device: str,
              describe: Callable[[str], None]) -> None:
        self._arguments, self._describe = (settings, d_ff, device), describe
        self._units = {job.index: job.unit for job in jobs}
        self._loaded = 0
        self._waiting = deque(jobs)
        self._pairs, self._ahead = {}, {}  # of the units submitted and not yet loaded
        self._in_flight = max(1, round(TASKS_PER_CPU * self._ray.cluster_resources().get("CPU", 1)))
        self._submit()

    def _submit(self) -> None:
        """Submit the next units' searches until ``_in_flight`` are under way (units without pairs skipped)."""
        while self._waiting and len(self._pairs) < self._in_flight:
            job = self._waiting.popleft()
            rows = job.read_rows()
            if rows is None:
                continue
            # np.asarray: a layer's rows are memory maps; the store gets their data, not the map.
            self._pairs[job.index] = self._ray.put(UnitRows(np.asarray(rows.x), np.asarray(rows.fired), rows.n_train))
            self._ahead[job.index] = self._search_task.remote(self._pairs[job.index], job.index, job.guessed_sizes,
                                                              job.guessed_start, *self._arguments)

    def load(self, index: int) -> bool:
        self._submit()  # units load in order: one not submitted yet is the next in line
        self._current = self._pairs.pop(index, None)  # dropping the reference frees the store's copy later
        self._fits = {} if self._current is None else self._result(index, self._ahead.pop(index))
        self._loaded += 1
        self._submit()
        return self._current is not None

    def fit(self, index: int, hidden: int) -> Fit:
        if hidden not in self._fits:
            self._fits[hidden] = self._result(index, self._fit_task.remote(self._current, index, hidden,
                                                                           *self._arguments))
        return self._fits[hidden]

    def _result(self, index: int, task):
        exceptions = self._ray.exceptions
        try:
            while not self._ray.wait([task], timeout=PROGRESS_SECONDS)[0]:
                self._show_progress(index)
            return self._ray.get(task)
        except exceptions.RayTaskError as exc:  # the task raised: its error, not Ray's wrapping of it
            cause = exc.cause if isinstance(exc.cause, Exception) else exc
            message = str(cause) if isinstance(cause, PitoolsError) else f"{type(cause).__name__}: {_first_line(cause)}"
        except exceptions.RayError as exc:  # lost: its worker or node died on every attempt, or its data
            message = f"{type(exc).__name__} (a lost worker or node is retried {MAX_RETRIES} times)"
        raise PitoolsError(f"{self._units[index]}: predictor training failed on the Ray cluster: {message}")

    def _show_progress(self, index: int) -> None:
        """Units searched so far across the cluster (loaded here, or their search task finished)."""
        ahead = list(self._ahead.values())
        finished = len(self._ray.wait(ahead, num_returns=len(ahead), timeout=0)[0]) if ahead else 0
        self._describe(f"predictors: {self._loaded + finished}/{len(self._units)} units searched on the cluster, "
                       f"waiting for {self._units[index]}")


def search_ahead(rows: UnitRows, index: int, sizes: list[int], start: int, settings: TrainSettings, d_ff: int,
                 device: str) -> dict[int, Fit]:
    """A Ray task: unit ``index``'s search on the guessed ``sizes`` and ``start``; every candidate it
    trained, by hidden size."""
    _crash_if_asked(index)
    data, xp = LayerPairs(*rows, d_ff), array_module(device)
    fits: dict[int, Fit] = {}

    def fit(hidden: int) -> Fit:
        fits[hidden] = train_candidate(data, index, hidden, settings, xp)
        return fits[hidden]

    choose_predictor(sizes, start, fit, settings)
    return fits


def fit_one(rows: UnitRows, index: int, hidden: int, settings: TrainSettings, d_ff: int, device: str) -> Fit:
    """A Ray task: unit ``index``'s candidate of size ``hidden``."""
    _crash_if_asked(index)
    return train_candidate(LayerPairs(*rows, d_ff), index, hidden, settings, array_module(device))


def _crash_if_asked(index: int) -> None:
    folder = os.environ.get(CRASHES_VARIABLE)
    if not folder:
        return
    try:
        os.unlink(Path(folder, f"crash-once-{index}"))  # atomic: one attempt alone finds the file
    except FileNotFoundError:
        if not Path(folder, f"crash-always-{index}").exists():
            return
    os._exit(1)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
