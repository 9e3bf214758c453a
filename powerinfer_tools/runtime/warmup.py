"""The compiled kernels a model needs, made before its first token rather than during it.

numba compiles each kernel for the argument types of its first call and keeps the machine code in its
cache (``__pycache__`` beside the source, or ``NUMBA_CACHE_DIR``), where a later process finds it in a
fraction of a second. With that cache empty, the bundled model's first ``pitools run`` spent tens of
seconds compiling before its first token, silently.

A *warm-up* (``exercise``) runs every compiled path a loaded model takes once: a prompt within the
kernels' token limit and one beyond it, then decoded tokens, in dense and (where the file allows) sparse
mode. Then numba's cache holds what this kind of model needs, and a marker says so:

    <marker folder>/pitools-warm-<key>.done

where the key covers all that decides which machine code a run needs: numba's version, each kernel
source's modification time and size (what numba's own cache index checks), the CPU, the model's kind
(architecture, each tensor's role and weight type, which metadata keys it has: two files converted
alike share it) and the load options that change the path (device, split, RAM budget). The marker folder
is the one numba's cache uses for these sources (in the package's ``__pycache__`` when it is writable),
so clearing that cache clears the markers too.

A run whose marker is missing, by ``Policy``:

* ``wait``: warms up in its own process before the first token, with a notice (``pitools serve``,
  ``pitools bench``, the Python API's default);
* ``background``: starts at once, its process on the NumPy reference kernels (as if numba were
  missing: ``kernels.use_reference``), while a detached process (``python -m
  powerinfer_tools.runtime.warmup``) warms up; the generation moves onto the compiled kernels between
  two steps once the build has marked them ready (``runtime.kernel_handover``), and the runs after it
  find them ready (``pitools run``'s default); a run while a build is under way (its lock held) starts
  no other. Where the NumPy kernels would be slower than waiting (a single core, a large model:
  ``kernel_handover.reason_to_wait``) it waits instead, as ``wait`` does. A warm-up that failed
  (or was killed) leaves ``.failed`` with its error, and later runs wait instead (so the error surfaces
  where it can be read, and the build is not started again and again);
* ``reference``: the NumPy reference kernels only, never compiled.
"""

from __future__ import annotations

import enum
import fcntl
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from importlib import metadata as package_metadata
from pathlib import Path

import numpy as np

from powerinfer_tools import kernels  # (numba is not imported by this: only once a compiled kernel is asked for)
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.model_file import ModelFile, open_model_file
from powerinfer_tools.kernels import numba_cache
from powerinfer_tools.runtime import kernel_handover

PROMPT_LENGTHS = (2, kernels.MAX_TOKENS + 8)  # one within the kernels' token limit, one beyond it (the reference)
DECODED_TOKENS = 2  # the one-token path, and its second step (a KV cache that already holds a token)


class Policy(str, enum.Enum):
    WAIT = "wait"
    BACKGROUND = "background"
    REFERENCE = "reference"


@dataclass(frozen=True)
class LoadOptions:
    """What ``LLM.load`` was asked that changes which compiled paths run (not the FFN mode: a warm-up
    runs both)."""

    device: str = "cpu"
    split: str | None = None
    use_split: bool = True
    ram: int | None = None
    cache_policy: str | None = None
    neuron_choice: str = "auto"


def model_kind(model_file) -> dict:
    """What of an open model file (``formats.model_file.ModelFile``) decides the argument types of its
    kernels: not its sizes or values, which numba does not specialise on."""
    roles = sorted({(re.sub(r"\.\d+\.", ".N.", name), int(t.qtype)) for name, t in model_file.tensors.items()})
    keys = sorted(k for k in model_file.metadata if not k.startswith(("tokenizer.", "general.")))
    return {"architecture": model_file.architecture, "powerinfer": model_file.powerinfer, "tensors": roles,
            "keys": keys}


def warm_key(kind: dict, options: LoadOptions) -> str:
    """The marker's key: this kind of model, loaded so, with these kernel sources and numba, on this CPU."""
    identity = {"numba": _version("numba"), "llama-cpp-python": _version("llama-cpp-python"), "cpu": _cpu(),
                "numba cpu": [os.environ.get("NUMBA_CPU_NAME"), os.environ.get("NUMBA_CPU_FEATURES")],
                "sources": numba_cache.sources_stamp(), "kind": kind, "options": asdict(options)}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def marker_folder() -> Path:
    """Where numba caches the kernels' code, and so where the markers go: ``NUMBA_CACHE_DIR`` when set,
    else the kernels' ``__pycache__`` when it can be written (numba's own first two choices), else the
    user's cache folder."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return Path(os.environ["NUMBA_CACHE_DIR"])
    in_tree = numba_cache.PACKAGE / "kernels" / "__pycache__"
    if os.access(in_tree if in_tree.is_dir() else in_tree.parent, os.W_OK):
        return in_tree
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pitools"


def _marker(key: str, suffix: str) -> Path:
    return marker_folder() / f"pitools-warm-{key}{suffix}"


def is_warm(key: str) -> bool:
    return _marker(key, ".done").is_file()


def failure(key: str) -> str | None:
    """The error of a background warm-up that failed for ``key``, if one did."""
    path = _marker(key, ".failed")
    return path.read_text(errors="replace").strip() or "unknown error" if path.is_file() else None


def exercise(engine, modes=None, prompt_lengths: tuple[int, ...] = PROMPT_LENGTHS,
             checks_logits: bool = False) -> None:
    """Run the compiled paths of ``engine`` (a ``RuntimeModel``) once, for numba to compile and cache them (or,
    cached, to load them): by default every path, in dense and (where the file allows) sparse mode; its FFN
    mode and statistics are left as they were. Logits that are not finite are refused only with ``checks_logits``
    (``RuntimeModel.checks_logits``): compiling needs no finite values, so a damaged file's kernels are built and
    marked as an intact one's, and its run is refused at its own first step, once."""
    from powerinfer_tools.interfaces import FFNMode
    from powerinfer_tools.runtime.engine import TokenStats

    saved = engine.mode, engine.stats, engine.checks_logits
    engine.stats = TokenStats()  # what these steps read is not the caller's to count
    engine.checks_logits = checks_logits
    if modes is None:
        modes = [FFNMode.DENSE] + ([FFNMode.SPARSE] if engine.can_run_sparse else [])
    vocab = engine.spec.vocab_size
    # Within the context window, however small: a prompt of at least one token, then what room is left.
    decoded = min(DECODED_TOKENS, engine.context_size - 1)
    try:
        for mode in modes:
            engine.mode = mode
            for length in prompt_lengths:
                length = max(1, min(length, engine.context_size - decoded))
                step = engine.step_fn()
                step(np.arange(1, length + 1) % vocab)
                for token in range(decoded):
                    step(np.array([token + 1]) % vocab)
            if decoded:  # a server's step: two sequences' first tokens, then a token each over its own cache
                caches = [engine.new_cache() for _ in range(2)]
                for first in (1, 3):
                    engine.forward_batch([np.array([first]) % vocab, np.array([first + 1]) % vocab], caches)
    finally:
        engine.mode, engine.stats, engine.checks_logits = saved


def load_compiled(engine) -> None:
    """Bring the compiled code a short request runs in ``engine``'s mode into this process (from numba's
    cache), so that the first request does not wait for it: a server does this before it listens, and a file
    whose weights spoil that request's logits is refused then."""
    exercise(engine, modes=[engine.mode], prompt_lengths=PROMPT_LENGTHS[:1], checks_logits=True)


def mark_warm(key: str) -> None:
    folder = marker_folder()
    folder.mkdir(parents=True, exist_ok=True)
    _marker(key, ".done").touch()
    _marker(key, ".failed").unlink(missing_ok=True)


def start_background(path: Path, options: LoadOptions, key: str) -> subprocess.Popen:
    """Start a detached process that warms up ``path`` loaded with ``options``; it outlives this one (its own
    session: a Ctrl-C here does not stop it), and exits at once if another warm-up of ``key`` holds the lock."""
    folder = marker_folder()
    folder.mkdir(parents=True, exist_ok=True)
    with open(_marker(key, ".log"), "wb") as log:
        return subprocess.Popen(_build_command(path, options, key), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True, env=build_environment())


class BackgroundBuild:
    """A build of ``key``'s kernels in another process, as a run on the reference watches it: ``process`` where
    this run started it, None where another run's was under way."""

    POLL_SECONDS = 0.1  # between two looks at a build waited for

    def __init__(self, key: str, process: subprocess.Popen | None):
        self.key, self.process = key, process

    def ready(self) -> bool:
        """Whether the build has made the kernels (its marker)."""
        return is_warm(self.key)

    def ended(self) -> bool:
        """Whether the build is over, whether it made them or not."""
        return self.process.poll() is not None if self.process is not None else not _build_under_way(self.key)

    def wait(self) -> bool:
        """Until the build has made the kernels or is over without them (its process goes on a while after its
        marker: it finishes the load it warmed up in); whether it made them."""
        while not self.ready() and not self.ended():
            time.sleep(self.POLL_SECONDS)
        return self.ready()


def build_elsewhere_and_wait(path: Path, options: LoadOptions) -> bool:
    """Warm up ``path`` loaded with ``options`` in a child process and wait for it, unless its kernels are ready
    (or there is nothing to compile): so that a process that loads it next (a benchmark's engine) finds the
    kernels cached and holds none of the compiler's memory. Whether it built them; a build that failed
    raises ``PitoolsError`` with its error."""
    if _nothing_to_compile():
        return False
    key = warm_key(model_kind(open_model_file(path)), options)
    marker_folder().mkdir(parents=True, exist_ok=True)
    with open(_marker(key, ".lock"), "a") as lock:  # a build under way (a run's, in the background) ends first
        fcntl.flock(lock, fcntl.LOCK_EX)
    if is_warm(key):
        return False
    with open(_marker(key, ".log"), "wb") as log:
        subprocess.run(_build_command(path, options, key), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                       env=build_environment())
    if not is_warm(key):
        raise PitoolsError(f"{path}: building the compiled kernels failed: {failure(key) or 'no error recorded'}")
    return True


def _build_command(path: Path, options: LoadOptions, key: str) -> list[str]:
    return [sys.executable, "-m", __name__, str(Path(path).resolve()), json.dumps(asdict(options)), key]


def build_environment() -> dict[str, str]:
    """The build's environment: this process's, with the package this process imported first on the path and the
    working folder off it (``PYTHONSAFEPATH``). ``python -m`` would otherwise put the working folder first, and a
    run started beside another checkout would have that one's sources compiled, under another key than the run's
    (whose marker then read as a failed build)."""
    path = os.pathsep.join(filter(None, [str(numba_cache.PACKAGE.parent), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PITOOLS_KERNELS": Policy.WAIT.value, "PYTHONSAFEPATH": "1", "PYTHONPATH": path}


def _background_main(path: str, options_json: str, key: str) -> None:
    """The detached warm-up: load the model as the run did, exercise it, mark it warm (or failed). At the run's
    priority, not below it: the run moves onto what this builds as soon as it is built."""
    folder = marker_folder()
    folder.mkdir(parents=True, exist_ok=True)
    with open(_marker(key, ".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # another warm-up of this kind is under way
        if is_warm(key):
            return
        # Until it succeeds, a build that ends is a failed one, also when it is killed or crashes (mark_warm
        # removes this): the runs after it then compile in process instead of starting it again and again.
        _marker(key, ".failed").write_text(f"the background build did not finish; see {_marker(key, '.log')}\n")
        try:
            from powerinfer_tools.runtime.llm import LLM

            options = LoadOptions(**json.loads(options_json))
            # warms up, marks it warm; sparse, not auto: timing the modes here, beside the run that started
            # this build, would measure that run's load (the next foreground run measures them)
            LLM.load(path, mode="sparse", kernels=Policy.WAIT, **_load_arguments(options))
        except BaseException as exc:
            _marker(key, ".failed").write_text(f"{type(exc).__name__}: {exc}\n")
            raise


def prepare(model_file: ModelFile, options: LoadOptions, policy: Policy | str, notice=None):
    """Before ``LLM.load`` loads ``model_file`` (``open_model_file``'s): choose this process's kernels by
    ``policy`` (the layouts a model is loaded in depend on it), and return what to call on the loaded engine:
    it starts the background build or warms the engine up, saying so in one line through ``notice`` (a
    callable, or None), and returns, where this process starts on the reference while a build is under way, that
    ``BackgroundBuild`` (else None). Nothing is said or started for a file that then fails to load."""
    policy = Policy(policy)
    say = notice or (lambda line: None)
    if policy is Policy.REFERENCE:
        kernels.use_reference("the reference kernels were asked for")
        return _nothing
    kernels.use_reference(None)
    if _nothing_to_compile():
        return _nothing  # the reference serves (kernels.available says why, once)
    key = warm_key(model_kind(model_file), options)
    if is_warm(key):
        return _nothing
    building = _build_under_way(key)
    failed = None if building else failure(key)
    wait_instead = kernel_handover.reason_to_wait(model_file) if policy is Policy.BACKGROUND else None
    if policy is Policy.BACKGROUND and failed is None and wait_instead is None:
        kernels.use_reference("the compiled kernels are being built in the background")

        def build_elsewhere(engine) -> BackgroundBuild:
            process = None if building else start_background(model_file.path, options, key)
            kernels.load_cpu_library()  # now, within the load's OpenMP settings: the move comes after the load
            say("the compiled kernels for this kind of model are being built in the background (once on this "
                "machine, about half a minute): this run starts on the slower NumPy kernels and moves onto the "
                "compiled ones as soon as they are ready (it waits for them instead once a token on the NumPy "
                f"kernels takes over {kernel_handover.SLOW_STEP_SECONDS:g} s)")
            return BackgroundBuild(key, process)

        return build_elsewhere

    def build_here(engine) -> None:
        why = (f"; the background build had failed: {failed}" if failed
               else f"; waiting for them: {wait_instead}" if wait_instead else "")
        say(f"compiling the kernels for this kind of model (once on this machine, about half a minute){why}")
        exercise(engine)
        mark_warm(key)

    return build_here


def _nothing(engine) -> None:
    return None


def _build_under_way(key: str) -> bool:
    """Whether a background build of ``key`` holds its lock now."""
    try:
        lock = open(_marker(key, ".lock"))
    except OSError:
        return False
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False  # (the lock goes with the file's closing)


def _load_arguments(options: LoadOptions) -> dict:
    arguments = {"device": options.device, "split": options.split, "use_split": options.use_split,
                 "ram": options.ram}
    if options.cache_policy is not None:
        arguments["cache_policy"] = options.cache_policy
    return arguments | {"neuron_choice": options.neuron_choice}


def _nothing_to_compile() -> bool:
    """Without numba or llama-cpp-python (ggml's routines) no compiled kernel runs: the reference serves."""
    return _version("numba") is None or _version("llama-cpp-python") is None


def _version(package: str) -> str | None:
    try:
        return package_metadata.version(package)
    except package_metadata.PackageNotFoundError:
        return None


def _cpu() -> str:
    """The CPU model and its feature flags (what numba's code is compiled for), cheaply: without LLVM."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    first = text.split("\n\n", 1)[0]
    fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
    clean = {k.strip(): v.strip() for k, v in fields.items()}
    return f"{platform.machine()} {clean.get('model name', '')} {clean.get('flags', clean.get('Features', ''))}"


if __name__ == "__main__":
    _background_main(*sys.argv[1:4])
