"""numba's cache of our compiled functions: machine code that no longer matches the package's sources dropped
before it runs, and what is kept loaded without numba's compiler.

**Stale code.** numba checks a cached function against the one source file that defines it (its modification
time and size) and nothing else. But a compiled function holds the machine code of what it calls from other files: every
kernel inlines ``numba_kernels``' decoders and intrinsics, the compiled decoder inlines ``ffn_decode`` and
``thresholded_decode``. After a change to a callee's file alone, the caller's cached code keeps computing the
callee's old arithmetic, silently: a CATS rule changed in ``thresholded_decode`` left the compiled decoder's
logits as they were until the cache was cleared by hand (``tests/test_decode_parity.py`` passed with CATS
keeping every neuron). This happens to an editable install after an edit, and to a cache kept apart from the
package (``NUMBA_CACHE_DIR``) after an upgrade.

So each module that caches compiled functions ends with ``prepare_cache(globals())``. A stamp beside the
module's entries in numba's cache names the sources it was filled from (``sources_stamp``: every file of
``NUMBA_SOURCES``, with its modification time and size, and numba's version); where the stamp is not that of the
sources now, the module's cached functions are flushed before any of them has run, and the stamp is written.

**Loading without the compiler.** Before it loads a cached function numba installs its typing and lowering
registries (``target_context.refresh()``: it imports ~60 more of its modules, SciPy's BLAS among them), which
only compiling uses: a large share of a warm ``pitools run`` (cProfile), every process. Loading machine code
needs only numba's runtime (NRT: the functions that compiled code calls to allocate and count references), and
compiling refreshes the registries itself (``numba.core.compiler.CompilerBase``). So our functions' caches load
their entries after ``rtsys.initialize`` alone; a function that is not in the cache compiles as before.

**LLVM's pages handed back.** Loading links the cached object code with LLVM (libllvmlite, 179 MB here), whose
import and first link leave ~69 MiB of its code resident in the process: a tenth of a warm run's peak RSS at the
TinyLlama shape, never used again unless something compiles. After each load, ``release_compiler_pages`` drops
those pages from the process (``madvise(MADV_DONTNEED)``, as the loader does to file pages it has copied): they
stay in the page cache, and the next load or compilation faults back the ~10 MiB it uses (docs/lab/kernels.md).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import json
import mmap
import re
from importlib import metadata
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # powerinfer_tools/
# powerinfer_tools.formats: the repository's formats/ (pyproject's package-dir), wherever an install put it
FORMATS = Path(importlib.util.find_spec("powerinfer_tools.formats").submodule_search_locations[0]).resolve()
# The sources of compiled code: a change to any of them makes every cached function stale (and the warm-up
# markers, runtime.warmup).
NUMBA_SOURCES = (PACKAGE / "kernels", PACKAGE / "predictors" / "logit_gradient.py",
                 *(PACKAGE / "runtime" / name
                   for name in ("compiled_decode.py", "ffn_decode.py", "thresholded_decode.py")),
                 # what the decoder inlines: the thresholds' test (``clears``), a neuron's activation, the
                 # predictor's rule, the attention scores' soft-cap; and the weight types' rows, whose kernels the
                 # dispatch on a type is built from
                 FORMATS / "activation_thresholds.py", FORMATS / "activations.py", FORMATS / "predictor_rule.py",
                 FORMATS / "soft_cap.py", FORMATS / "weight_types.py")


def source_files(sources=NUMBA_SOURCES) -> list[tuple[str, int, int]]:
    """``(path, modification time in ns, size)`` of each file of ``sources`` (files, or folders of them), sorted."""
    return sorted((str(p), p.stat().st_mtime_ns, p.stat().st_size)
                  for root in map(Path, sources) for p in ([root] if root.is_file() else root.glob("*.py")))


@functools.cache
def sources_stamp(sources=NUMBA_SOURCES) -> str:
    identity = {"sources": source_files(sources), "numba": metadata.version("numba")}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def prepare_cache(namespace: dict, sources=NUMBA_SOURCES) -> None:
    """Have the cached functions defined in the module of ``namespace`` (its ``globals()``) load without numba's
    registries, and flush them if their entries in numba's cache were not made from ``sources`` as they are now;
    then stamp them as made from these."""
    from numba.core.dispatcher import Dispatcher  # numba is loaded by then; the warm-up's key (no numba) reads the rest

    module = namespace["__name__"]
    # ``_cache`` is numba's own attribute: the cache that cache=True gave a dispatcher (without: a NullCache,
    # whose path is None)
    cached = [value for value in namespace.values() if isinstance(value, Dispatcher)
              and value.py_func.__module__ == module and value._cache.cache_path is not None]
    if not cached:
        return
    for dispatcher in cached:
        if all(hasattr(dispatcher._cache, name) for name in _CACHE_METHODS_USED):  # else numba's own, as it is
            dispatcher._cache.load_overload = functools.partial(_load_without_registries, dispatcher._cache)
    flush_if_stale([dispatcher._cache for dispatcher in cached], namespace["__file__"], sources)


def flush_if_stale(caches: list, module_file: str, sources=NUMBA_SOURCES) -> None:
    """Flush ``caches`` (numba's caches of functions of the module ``module_file``: a dispatcher's, or those a
    module makes for its ``cfunc``s before compiling them) unless the module's stamp says they were made from
    ``sources`` as they are now; then stamp them as made from these."""
    folder, stem = Path(caches[0].cache_path), Path(module_file).stem
    stamp = folder / f"{stem}.pitools-sources-{sources_stamp(tuple(sources))}"
    if stamp.is_file():
        return
    try:
        for cache in caches:
            cache.flush()
        for old in folder.glob(f"{stem}.pitools-sources-*"):
            old.unlink(missing_ok=True)
        stamp.touch()
    except OSError:  # a cache folder this process cannot write: numba cannot save there either
        pass


def cached_cfuncs(pythons: list, signature, module_file: str, sources=NUMBA_SOURCES) -> list:
    """numba's ``cfunc(signature, cache=True)`` of each of ``pythons`` (functions of the module ``module_file``),
    compiled now, their caches prepared as ``prepare_cache`` prepares a dispatcher's: flushed where stale, loaded
    without numba's registries."""
    from numba.core import sigutils
    from numba.core.ccallback import CFunc

    functions = [CFunc(python, sigutils.normalize_signature(signature), locals={}, options={}) for python in pythons]
    for function in functions:
        function.enable_caching()
        if all(hasattr(function._cache, name) for name in _CACHE_METHODS_USED):  # (numba's own attribute, as above)
            function._cache.load_overload = functools.partial(_load_without_registries, function._cache)
    flush_if_stale([function._cache for function in functions], module_file, sources)
    for function in functions:
        function.compile()
    return functions


# numba's private methods that _load_without_registries calls (numba 0.68's; a numba without them loads as it does)
_CACHE_METHODS_USED = ("_load_overload", "_guard_against_spurious_io_errors")


def _load_without_registries(cache, signature, target_context):
    """numba's ``Cache.load_overload`` (numba/core/caching.py) less its ``target_context.refresh()``: the runtime
    that loaded code calls into, and the entry for ``signature`` or None."""
    from numba.core.runtime import rtsys

    rtsys.initialize(target_context)
    with cache._guard_against_spurious_io_errors():
        loaded = cache._load_overload(signature, target_context)
    if loaded is not None:
        release_compiler_pages()
    return loaded


def release_compiler_pages() -> None:
    """Drop LLVM's code from this process's resident memory; it comes back from the page cache where used."""
    for start, length in _compiler_code_spans():
        _madvise()(start, length, mmap.MADV_DONTNEED)


@functools.cache
def _madvise():
    """libc's ``madvise``, for address ranges that are no mmap object of Python's (``mmap.madvise`` takes those)."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


@functools.cache
def _compiler_code_spans() -> tuple[tuple[int, int], ...]:
    """``(start, length)`` of each mapping of LLVM's library that holds its file's pages and nothing else: not
    writable, and without a page of its own (``Anonymous: 0 kB``: no relocation was written into it), so that
    dropping its pages cannot change what it reads. Found once: a library loaded stays where it is. Empty off
    Linux (no /proc/self/smaps, or no MADV_DONTNEED)."""
    from llvmlite.binding import ffi

    if not hasattr(mmap, "MADV_DONTNEED"):
        return ()
    library = str(Path(ffi.__file__).resolve().parent / ffi.get_library_name())
    try:
        smaps = Path("/proc/self/smaps").read_text()
    except OSError:
        return ()
    spans = []
    # One block a mapping: its line (address range, permissions, offset, device, inode, path), then its fields,
    # the last of which is VmFlags. Only the library's blocks are split into lines: the others are many.
    for block in smaps.split("\nVmFlags:"):
        head, _, fields = block.partition(f" {library}\n")
        if not fields:
            continue
        addresses, permissions = head.rsplit("\n", 1)[-1].split()[:2]
        if "w" not in permissions and re.search(r"^Anonymous:\s+0 kB$", fields, re.MULTILINE):
            start, end = (int(address, 16) for address in addresses.split("-"))
            spans.append((start, end - start))
    return tuple(spans)
