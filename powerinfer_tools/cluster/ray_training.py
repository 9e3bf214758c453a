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
way at a time (``ray_session.TASKS_PER_CPU``), so the store holds that many units' pairs, not the whole
profile. The nodes need no shared file system: only this process reads the profile and writes the
predictor folder. Every node needs pitools (the same version) and Ray installed.

Faults: a task whose worker process or node dies is retried by Ray (``ray_session.MAX_RETRIES``); a task that
raises, or dies on every attempt, ends the command with one error naming the unit. The predictor
folder holds the units finished before it, written in order (atomically), so the same command
resumes after them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from powerinfer_tools.cluster.ray_session import RayCluster, crash_if_asked
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


class RayCandidates:
    """``trainer.Candidates`` trained by Ray tasks (the module docstring says how)."""

    def __init__(self, cluster: RayCluster):
        self._cluster = cluster
        self._search_task = cluster.task(search_ahead)
        self._fit_task = cluster.task(fit_one)

    def start(self, jobs: list[UnitJob], settings: TrainSettings, d_ff: int, device: str,
              describe: Callable[[str], None]) -> None:
        self._arguments, self._describe = (settings, d_ff, device), describe
        self._units = {job.index: job.unit for job in jobs}
        self._loaded = 0
        self._waiting = deque(jobs)
        self._pairs, self._ahead = {}, {}  # of the units submitted and not yet loaded
        self._in_flight = self._cluster.tasks_in_flight()
        self._submit()

    def _submit(self) -> None:
        """Submit the next units' searches until ``_in_flight`` are under way (units without pairs skipped)."""
        while self._waiting and len(self._pairs) < self._in_flight:
            job = self._waiting.popleft()
            rows = job.read_rows()
            if rows is None:
                continue
            # np.asarray: a layer's rows are memory maps; the store gets their data, not the map.
            self._pairs[job.index] = self._cluster.ray.put(UnitRows(np.asarray(rows.x), np.asarray(rows.fired),
                                                                    rows.n_train))
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
        return self._cluster.result(task, f"{self._units[index]}: predictor training",
                                    waiting=lambda: self._show_progress(index))

    def _show_progress(self, index: int) -> None:
        """Units searched so far across the cluster (loaded here, or their search task finished)."""
        ahead = list(self._ahead.values())
        finished = len(self._cluster.ray.wait(ahead, num_returns=len(ahead), timeout=0)[0]) if ahead else 0
        self._describe(f"predictors: {self._loaded + finished}/{len(self._units)} units searched on the cluster, "
                       f"waiting for {self._units[index]}")


def search_ahead(rows: UnitRows, index: int, sizes: list[int], start: int, settings: TrainSettings, d_ff: int,
                 device: str) -> dict[int, Fit]:
    """A Ray task: unit ``index``'s search on the guessed ``sizes`` and ``start``; every candidate it
    trained, by hidden size."""
    crash_if_asked(str(index))
    data, xp = LayerPairs(*rows, d_ff), array_module(device)
    fits: dict[int, Fit] = {}

    def fit(hidden: int) -> Fit:
        fits[hidden] = train_candidate(data, index, hidden, settings, xp)
        return fits[hidden]

    choose_predictor(sizes, start, fit, settings)
    return fits


def fit_one(rows: UnitRows, index: int, hidden: int, settings: TrainSettings, d_ff: int, device: str) -> Fit:
    """A Ray task: unit ``index``'s candidate of size ``hidden``."""
    crash_if_asked(str(index))
    return train_candidate(LayerPairs(*rows, d_ff), index, hidden, settings, array_module(device))
