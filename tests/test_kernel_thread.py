"""The kernels keep one set of threads for the life of the process, whichever Python thread runs the model
(``kernels.kernel_thread``): a second team of OpenMP threads halves both teams' speed on a 2-core machine."""

from __future__ import annotations

import os
import threading

import numba
import pytest

from powerinfer_tools import kernels
from powerinfer_tools.kernels import kernel_thread
from powerinfer_tools.runtime.llm import LLM


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _in_new_thread(fn):
    """``fn()``'s result, computed on a Python thread of its own (which ends before this returns)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


def test_every_caller_runs_on_one_thread_and_gets_its_own_result_or_exception():
    here = kernel_thread.call(threading.current_thread)
    assert _in_new_thread(lambda: kernel_thread.call(threading.current_thread)) is here is not threading.current_thread()
    assert kernel_thread.call(lambda a, b=0: a + b, 2, b=3) == 5
    assert kernel_thread.call(kernel_thread.is_kernel_thread) and not kernel_thread.is_kernel_thread()
    assert kernel_thread.call(kernel_thread.call, lambda: 7) == 7  # already there: run at once, no deadlock
    with pytest.raises(ZeroDivisionError):
        kernel_thread.call(lambda: 1 / 0)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts the process's threads in /proc")
def test_generating_from_a_second_python_thread_starts_no_second_team_of_kernel_threads(bundled_gguf):
    if numba.config.NUMBA_NUM_THREADS < 2 or not kernels.available():
        pytest.skip("one kernel thread, or no compiled kernels: no team to multiply")
    threads = kernels.get_threads()
    kernels.set_threads(2)
    try:
        llm = LLM.load(bundled_gguf("q8_0"), mode="dense")  # the compiled decoder and the prompt's kernels
        assert "compiled decoder" in llm.description
        first = "".join(llm.generate("def ", max_tokens=4))
        before = _os_threads()  # this process's threads, the kernel thread's team among them

        def generate_and_count():
            return "".join(llm.generate("def ", max_tokens=4)), _os_threads()

        text, during = _in_new_thread(generate_and_count)
    finally:
        kernels.set_threads(threads)
    assert text == first
    assert during == before + 1, "the second Python thread's calls started threads of their own"
