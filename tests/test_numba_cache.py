"""``kernels.numba_cache``: a cached compiled function whose callee in another file changed runs the new callee."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from powerinfer_tools.kernels import numba_cache

CALLER = """from numba import njit

from callee import plus


@njit(cache=True)
def twice_plus(x):
    return 2 * plus(x)
"""
GUARD = """
from powerinfer_tools.kernels.numba_cache import prepare_cache

prepare_cache(globals(), sources={sources!r})
"""


def _write_callee(folder: Path, step: int, mtime_ns: int) -> None:
    callee = folder / "callee.py"
    callee.write_text(f"from numba import njit\n\n\n@njit(cache=True)\ndef plus(x):\n    return x + {step}\n")
    os.utime(callee, ns=(mtime_ns, mtime_ns))  # distinct times, however coarse the file system's clock


def _run_in(folder: Path, code: str) -> list[str]:
    """The lines ``code`` prints in a new process that imports from the folder, numba's cache in it."""
    env = {**os.environ, "PYTHONPATH": str(folder), "NUMBA_CACHE_DIR": str(folder / "cache")}
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=folder, check=True, capture_output=True,
                          text=True).stdout.splitlines()


def _twice_plus_one(folder: Path) -> int:
    """``caller.twice_plus(1)`` in a new process."""
    return int(_run_in(folder, "import caller; print(caller.twice_plus(1))")[-1])


@pytest.mark.parametrize("guarded", [True, False], ids=["prepare_cache", "numba alone"])
def test_a_callee_changed_in_another_file_is_recomputed(tmp_path, guarded):
    sources = (str(tmp_path / "callee.py"), str(tmp_path / "caller.py"))
    (tmp_path / "caller.py").write_text(CALLER + (GUARD.format(sources=sources) if guarded else ""))
    _write_callee(tmp_path, 1, 10**18)
    assert _twice_plus_one(tmp_path) == 4
    _write_callee(tmp_path, 2, 10**18 + 10**11)
    if guarded:
        assert _twice_plus_one(tmp_path) == 6
    else:  # what the stamp is for: numba checks the caller's own file alone, and runs the old callee
        assert _twice_plus_one(tmp_path) == 4, "numba now notices a changed callee: numba_cache may go"


def test_every_module_that_caches_compiled_code_drops_stale_code():
    """A module left out would keep the machine code of its callees in other files as it was when cached."""
    modules = [p for p in numba_cache.PACKAGE.rglob("*.py")
               if "cache=True)" in p.read_text() and p.name != "numba_cache.py"]
    assert len(modules) >= 10
    last_lines = {p: p.read_text().rstrip().splitlines()[-1] for p in modules}
    missing = [str(p) for p, line in last_lines.items() if not line.startswith("prepare_cache(globals())")]
    assert not missing, missing


LOADED_THEN_COMPILED = """
import sys
import numpy as np
from numba import njit
import caller

print(caller.twice_plus(1))
print("registries loaded:", "numba.cpython.printimpl" in sys.modules)  # imported by numba's refresh() alone
resident, mapping = 0, ""
for line in open("/proc/self/smaps") if sys.platform == "linux" else ():  # LLVM's pages in this process
    fields = line.split()
    if not fields[0].endswith(":"):
        mapping = fields[-1]
    elif fields[0] == "Rss:" and mapping.endswith("libllvmlite.so"):
        resident += int(fields[1])
print("LLVM resident MiB:", resident // 1024)

@njit
def product(a, b):
    return np.dot(a, b)  # compiling, with the registries (and the BLAS check) it loads itself

a = np.arange(9.0).reshape(3, 3)
print("compiled after:", bool(np.allclose(product(a, a), a @ a)), caller.twice_plus(2.5))
"""


def test_cached_code_loads_without_numbas_registries_or_llvms_pages_and_compiling_still_works(tmp_path):
    sources = (str(tmp_path / "callee.py"), str(tmp_path / "caller.py"))
    (tmp_path / "caller.py").write_text(CALLER + GUARD.format(sources=sources))
    _write_callee(tmp_path, 1, 10**18)
    runs = [_run_in(tmp_path, LOADED_THEN_COMPILED) for _ in range(2)]
    llvm_resident = [int(run.pop(2).removeprefix("LLVM resident MiB: ")) for run in runs]
    # the first process compiles twice_plus (registries loaded); the second loads it from the cache (not loaded)
    assert runs[0] == ["4", "registries loaded: True", "compiled after: True 7.0"], runs[0]
    assert runs[1] == ["4", "registries loaded: False", "compiled after: True 7.0"], runs[1]
    # compiling leaves tens of MiB of LLVM's code resident; a load hands them back (release_compiler_pages, which
    # reads Linux's /proc/self/smaps)
    if sys.platform == "linux":
        assert llvm_resident[0] >= 20 and llvm_resident[1] <= 2, llvm_resident
