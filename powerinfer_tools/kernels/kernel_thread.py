"""One Python thread runs every model computation of the process, whichever thread asks for it.

numba's parallel loops run on its OpenMP threading layer, and libgomp keeps a team of threads for each
Python thread that starts a parallel loop. Once two Python threads have run the kernels there are two teams
(on a 2-core machine, four threads for two cores), and libgomp, seeing more threads than cores, stops letting
its waiting threads spin: every one of a token's fork/joins then waits for a thread to be woken, and both
threads' kernels run at about half speed for the rest of the process (a server warms its model on one
thread and generates on another; an API caller generates from a worker thread). numba's other layers are
no way out: ``workqueue`` has its threads sleep between loops (the same wake-ups) and aborts the process
when two threads start loops at once, and ``tbb`` is a further dependency.

So the model's entry points (``loader.load_runtime_model``, ``RuntimeModel.forward``) run on one dedicated
thread: ``call`` hands a computation to it and waits, or runs it at once where it is already there. One hand-over
per forward pass (a token's, or a prompt's) costs a thread switch, not a team: the kernels keep one set of threads
for the life of the process. It also makes the model's buffers safe from two threads at once (the compiled
decoder's scratch is one per model): computations run one after another, in the order they were asked for.
"""

from __future__ import annotations

import functools
import queue
import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

T = TypeVar("T")

_tasks: "queue.SimpleQueue[tuple[Future, Callable, tuple, dict]]" = queue.SimpleQueue()
_thread: threading.Thread | None = None
_started = threading.Lock()


def call(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` computed on the kernel thread: its result, or its exception raised here."""
    if threading.current_thread() is _thread:
        return fn(*args, **kwargs)
    _start()
    done: Future = Future()
    _tasks.put((done, fn, args, kwargs))
    return done.result()


def runs_model_work(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` made to compute on the kernel thread, whoever calls it (``call``)."""

    @functools.wraps(fn)
    def on_kernel_thread(*args, **kwargs):
        return call(fn, *args, **kwargs)

    return on_kernel_thread


def is_kernel_thread() -> bool:
    """Whether the calling thread is the one that runs the kernels."""
    return threading.current_thread() is _thread


def _start() -> None:
    global _thread
    with _started:
        if _thread is None:
            # A daemon: a process that ends (the last request answered, Ctrl-C) does not wait for it.
            _thread = threading.Thread(target=_serve, name="pitools-kernels", daemon=True)
            _thread.start()


def _serve() -> None:
    while True:
        done, fn, args, kwargs = _tasks.get()
        if not done.set_running_or_notify_cancel():
            continue
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to the caller, whatever it is
            done.set_exception(exc)
