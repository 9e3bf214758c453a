"""Compiled kernels made before the first token (``runtime.warmup``): which policy runs what, the marker
that says a kind of model is compiled for, and the NumPy reference a run starts on meanwhile."""

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from powerinfer_tools import kernels
from powerinfer_tools.formats.model_file import open_model_file
from powerinfer_tools.kernels import numba_cache
from powerinfer_tools.runtime import kernel_handover, warmup
from powerinfer_tools.runtime.warmup import LoadOptions, Policy
from powerinfer_tools.runtime.llm import LLM, load_options


@pytest.fixture(autouse=True)
def markers(tmp_path, monkeypatch):
    """Markers in a folder of this test's own (numba's cache stays where it is: these tests compile nothing new);
    the process's kernels reset after."""
    monkeypatch.setattr(warmup, "marker_folder", lambda: tmp_path / "markers")
    yield tmp_path / "markers"
    kernels.use_reference(None)


@pytest.fixture
def background_starts(monkeypatch):
    """The background builds started (none is), on a machine with idle cores (where a run starts beside its build)."""
    monkeypatch.setattr(kernels, "idle_cores", lambda: 4.0)
    started = []
    monkeypatch.setattr(warmup, "start_background", lambda path, options, key: started.append((path, options, key)))
    return started


def _load(path, policy, lines=None):
    return LLM.load(path, kernels=policy, notice=None if lines is None else lines.append)


def test_background_starts_on_the_reference_and_leaves_the_compiling_to_another_process(bundled_gguf,
                                                                                        background_starts):
    path, lines = bundled_gguf("q8_0"), []
    llm = _load(path, Policy.BACKGROUND, lines)
    assert kernels.reference_chosen() and not kernels.available()
    assert "NumPy kernels" in llm.description
    assert llm.engine.compiled_decoder() is None
    assert len(lines) == 1 and "background" in lines[0] and "moves onto the compiled ones" in lines[0]
    assert llm.kernels_build is not None and not llm.kernels_build.ready()
    assert [(p, o) for p, o, _ in background_starts] == [(path, LoadOptions(use_split=False, cache_policy="lfu"))]
    assert len("".join(llm.generate("def ", 4))) > 0


@pytest.mark.parametrize("outtype", ["q8_0", "q4_0"])  # q4_0: its layouts as loaded on the reference (not interleaved)
def test_a_generation_begun_on_the_reference_moves_onto_the_compiled_kernels_once_they_are_built(
        bundled_gguf, background_starts, outtype):
    """The background build marks the kernels ready while a run generates on the reference: the run's next step
    is compiled, the KV cache carried on, and its greedy text is the text of a run compiled throughout."""
    path = bundled_gguf(outtype)
    llm = _load(path, Policy.BACKGROUND)
    assert kernels.reference_chosen()
    ((_, _, key),) = background_starts
    pieces = []
    for piece in llm.generate("def ", 24):
        pieces.append(piece)
        if len(pieces) == 3:
            warmup.mark_warm(key)  # as the build does when it is done
    stats = llm.last_stats
    assert 3 <= stats.handover.reference_steps < stats.generated_tokens and not stats.handover.waited
    assert not kernels.reference_chosen() and llm.engine.compiled_decoder() is not None
    assert llm.kernels_build is None
    assert "NumPy kernels" not in llm.description and llm.description.endswith("tokens decoded by the compiled decoder")
    compiled = _load(path, Policy.WAIT)
    assert "".join(pieces) == "".join(compiled.generate("def ", 24))
    assert compiled.last_stats.handover is None  # compiled throughout


def test_a_generation_that_ends_before_the_build_stays_on_the_reference_and_the_next_one_moves(
        bundled_gguf, background_starts):
    llm = _load(bundled_gguf("q8_0"), Policy.BACKGROUND)
    "".join(llm.generate("def ", 4))
    assert llm.last_stats.handover is None and "NumPy kernels" in llm.description
    ((_, _, key),) = background_starts
    warmup.mark_warm(key)
    "".join(llm.generate("def ", 4))
    assert llm.last_stats.handover == kernel_handover.Handover(0, False)
    assert "NumPy kernels" not in llm.description


@pytest.mark.parametrize("builds", [True, False])
def test_after_a_slow_step_on_the_reference_the_generation_waits_for_the_build(bundled_gguf, monkeypatch, markers,
                                                                               builds):
    """Where a token on the reference takes longer than SLOW_STEP_SECONDS (here every one), the generation takes no
    other while the build is under way: it waits, then moves; a build that ends without the kernels leaves it on
    the reference. The prompt's step is not judged (it pages the model in)."""
    monkeypatch.setattr(kernel_handover, "SLOW_STEP_SECONDS", 0.0)
    monkeypatch.setattr(kernels, "idle_cores", lambda: 4.0)
    path = bundled_gguf("q8_0")
    key = warmup.warm_key(warmup.model_kind(open_model_file(path)), LoadOptions(use_split=False, cache_policy="lfu"))
    markers.mkdir(parents=True)
    marker = markers / f"pitools-warm-{key}.done"
    build = f"import time, pathlib; time.sleep(1); {builds} and pathlib.Path({str(marker)!r}).touch()"
    monkeypatch.setattr(warmup, "start_background",
                        lambda *args: subprocess.Popen([sys.executable, "-c", build], start_new_session=True))
    llm = _load(path, Policy.BACKGROUND)
    text = "".join(llm.generate("def ", 8))
    assert llm.last_stats.handover == (kernel_handover.Handover(2, True) if builds else None)
    assert kernels.reference_chosen() is not builds
    if builds:
        assert text == "".join(_load(path, Policy.WAIT).generate("def ", 8))


def test_stepping_on_the_reference_pays_until_a_token_is_slow_or_the_tokens_wait_for_a_core():
    tokens = kernel_handover.ReferenceTokens()
    assert tokens.stepping_pays()
    tokens.add(0.4, 0.1)  # waiting for a core, but too few tokens to judge
    assert tokens.stepping_pays()
    for _ in range(3):
        tokens.add(0.4, 0.4)
    assert tokens.stepping_pays()  # 1.6 s of wall time for 1.3 of CPU: within CONTENDED
    tokens.add(0.4, 0.1)
    assert not tokens.stepping_pays()  # 2.0 s for 1.4
    slow = kernel_handover.ReferenceTokens()
    slow.add(kernel_handover.SLOW_STEP_SECONDS + 0.1, kernel_handover.SLOW_STEP_SECONDS + 0.1)
    assert not slow.stepping_pays()


def test_pitools_run_says_it_starts_on_the_reference_and_how_many_tokens_it_computed_there(bundled_gguf,
                                                                                            background_starts,
                                                                                            monkeypatch):
    from cli_checks import invoke

    looks = []  # the build's marker looked at before each step: ready at the fourth
    monkeypatch.setattr(warmup.BackgroundBuild, "ready", lambda self: looks.append(1) or len(looks) > 3)
    result = invoke("run", bundled_gguf("q8_0"), "-p", "def ", "-n", "8", "--kernels", "background")
    notice, summary = result.stderr.splitlines()
    assert "this run starts on the slower NumPy kernels and moves onto the compiled ones" in notice
    assert "| the first 3 tokens on the NumPy kernels, the rest on the compiled ones (built meanwhile) |" in summary
    description = summary.rsplit(" | ", 1)[1]
    assert description.endswith("tokens decoded by the compiled decoder") and "NumPy" not in description


@pytest.mark.parametrize("where, why", [("busy cores", "cores are idle"), ("a large model", "takes seconds a token")])
def test_background_waits_where_the_reference_would_be_slower_and_says_why(bundled_gguf, background_starts,
                                                                            monkeypatch, where, why):
    """Busy cores (or a single one): the reference's steps would take the build's time from it; a large model: each
    of its steps on the reference would take seconds, a prompt's more, and the run could end that much after the
    build."""
    if where == "busy cores":
        monkeypatch.setattr(kernels, "idle_cores", lambda: 1.2)
    else:
        monkeypatch.setattr(kernel_handover, "REFERENCE_WEIGHT_BYTES", 1000)  # the bundled model's are more
    lines = []
    llm = _load(bundled_gguf("q8_0"), Policy.BACKGROUND, lines)
    assert background_starts == [] and not kernels.reference_chosen() and llm.kernels_build is None
    assert len(lines) == 1 and "compiling" in lines[0] and "waiting for them: " in lines[0] and why in lines[0]


def test_the_build_imports_the_package_of_the_run_that_starts_it(tmp_path):
    """Not one that lies in the run's working folder (``python -m`` puts that first on its path)."""
    decoy = tmp_path / "powerinfer_tools"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("")
    code = "import powerinfer_tools; print(powerinfer_tools.__file__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path,
                         env=warmup.build_environment()).stdout
    assert Path(out.strip()) == numba_cache.PACKAGE / "__init__.py"


def test_wait_compiles_in_process_and_marks_the_kind_warm(bundled_gguf, background_starts):
    path, lines = bundled_gguf("q8_0"), []
    llm = _load(path, Policy.WAIT, lines)
    assert not kernels.reference_chosen() and "NumPy kernels" not in llm.description
    assert len(lines) == 1 and "compiling" in lines[0]
    key = warmup.warm_key(warmup.model_kind(open_model_file(path)), LoadOptions(use_split=False, cache_policy="lfu"))
    assert warmup.is_warm(key)
    again = []
    _load(path, Policy.BACKGROUND, again)  # now warm: nothing to say, nothing started, the compiled kernels
    assert again == [] and background_starts == [] and not kernels.reference_chosen()


def test_a_build_under_way_is_not_started_again(bundled_gguf, background_starts, markers):
    path = bundled_gguf("q8_0")
    key = warmup.warm_key(warmup.model_kind(open_model_file(path)), LoadOptions(use_split=False, cache_policy="lfu"))
    markers.mkdir(parents=True)
    with open(markers / f"pitools-warm-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as the background build holds it
        (markers / f"pitools-warm-{key}.failed").write_text("the background build did not finish\n")  # as it writes
        lines = []
        llm = _load(path, Policy.BACKGROUND, lines)
    assert background_starts == [] and "NumPy kernels" in llm.description and "background" in lines[0]


def test_a_failed_background_build_makes_later_runs_wait_and_say_why(bundled_gguf, background_starts, markers):
    path = bundled_gguf("q8_0")
    key = warmup.warm_key(warmup.model_kind(open_model_file(path)), LoadOptions(use_split=False, cache_policy="lfu"))
    markers.mkdir(parents=True)
    (markers / f"pitools-warm-{key}.failed").write_text("MemoryError: out of memory\n")
    lines = []
    _load(path, Policy.BACKGROUND, lines)
    assert background_starts == [] and not kernels.reference_chosen()
    assert "MemoryError: out of memory" in lines[0]
    assert warmup.is_warm(key) and warmup.failure(key) is None


def test_the_kind_ignores_sizes_and_names_but_not_weight_types(bundled_gguf):
    q8, f32 = (warmup.model_kind(open_model_file(bundled_gguf(t))) for t in ("q8_0", "f32"))
    assert q8 != f32
    assert warmup.model_kind(open_model_file(bundled_gguf("q8_0"))) == q8
    # Layers are one role each: a model with more layers of the same types is the same kind.
    assert not any(name.startswith("blk.0.") for name, _ in q8["tensors"])
    options = LoadOptions(use_split=False)
    assert warmup.warm_key(q8, options) != warmup.warm_key(q8, LoadOptions(use_split=False, ram=2**30))


def test_the_reference_policy_never_loads_numba(bundled_gguf):
    code = ("import sys; from powerinfer_tools.runtime.llm import LLM; "
            f"llm = LLM.load({str(bundled_gguf('q8_0'))!r}, kernels='reference'); "
            "text = ''.join(llm.generate('def ', 4)); print(len(text) > 0, 'numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False"]


def test_the_reference_and_the_compiled_kernels_agree(bundled_gguf):
    path = bundled_gguf("f32")  # float32 weights: the compiled products differ from NumPy's by rounding only
    compiled = _load(path, Policy.WAIT).engine
    ids = np.array([1, 5, 9])
    expected = compiled.step_fn()(ids)
    reference = _load(path, Policy.REFERENCE).engine
    np.testing.assert_allclose(reference.step_fn()(ids), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_pitools_run_on_a_cold_cache_answers_at_once_and_the_next_run_is_compiled(bundled_gguf, tmp_path,
                                                                                    monkeypatch):
    """A new machine, as the README's first command meets it: an empty numba cache, `pitools run`'s default."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cold")}
    monkeypatch.setattr(warmup, "marker_folder", lambda: tmp_path / "cold")
    env.pop("PITOOLS_KERNELS")
    # on an idle machine (the running threads are this machine's: a busy one makes the first run wait instead)
    cli = ("import sys; from powerinfer_tools import kernels; kernels.others_running = lambda *_, **__: 0; "
           "from powerinfer_tools.commands.cli import main; sys.argv[0] = 'pitools'; main()")
    run = [sys.executable, "-c", cli, "run", str(bundled_gguf("q8_0")), "-p", "def ", "-n", "4"]
    first = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120, check=True)
    assert "being built in the background" in first.stderr and "NumPy kernels" in first.stderr
    (log,) = (tmp_path / "cold").glob("pitools-warm-*.log")  # written by the run as it starts the build
    key = log.name.removeprefix("pitools-warm-").removesuffix(".log")
    deadline = time.monotonic() + 600
    while not warmup.is_warm(key):
        # A build writes .failed as it starts and removes it when done: only a .failed of a build no longer
        # under way is a failure (checked in that order: it may end in between).
        failed = warmup.failure(key)
        assert not (failed and not warmup._build_under_way(key) and not warmup.is_warm(key)), (failed, log.read_text())
        assert time.monotonic() < deadline, "the background build did not finish"
        time.sleep(1)
    assert not (tmp_path / "cold" / f"pitools-warm-{key}.failed").exists()
    second = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120, check=True)
    assert "NumPy kernels" not in second.stderr and "pitools:" not in second.stderr
    assert second.stdout.startswith("def ") and len(second.stdout) > len("def \n")


def test_load_compiled_runs_a_short_request_in_the_engines_mode_and_leaves_the_engine_as_it_was(bundled_gguf,
                                                                                              monkeypatch):
    """What `pitools serve` does before it listens: a prompt within the kernels' token limit and decoded tokens,
    on the path the first request will take, counted apart from the engine's statistics."""
    engine = _load(bundled_gguf("q8_0"), Policy.WAIT).engine
    mode, stats = engine.mode, engine.stats
    steps, forward = [], engine.forward
    monkeypatch.setattr(engine, "forward", lambda tokens, *a, **k: steps.append((len(tokens), engine.mode))
                        or forward(tokens, *a, **k))
    warmup.load_compiled(engine)
    assert steps == [(warmup.PROMPT_LENGTHS[0], mode)] + [(1, mode)] * warmup.DECODED_TOKENS
    assert engine.mode is mode and engine.stats is stats and stats.steps == 0


def test_the_warm_key_covers_every_source_numba_compiles():
    """A source of compiled code left out of the key would let a changed kernel pass for warm (and its cached
    callers keep its old machine code: ``kernels.numba_cache``, whose list the key takes)."""
    covered = {Path(path) for path, _, _ in numba_cache.source_files()}
    compiled = {p for p in numba_cache.PACKAGE.rglob("*.py") if "cache=True" in p.read_text()}
    assert compiled and compiled <= covered, sorted(str(p) for p in compiled - covered)


def test_a_build_elsewhere_starts_no_process_for_warm_kernels_and_reports_a_failed_one(bundled_gguf, markers,
                                                                                      monkeypatch):
    path, options = bundled_gguf("q8_0"), load_options(use_split=False)
    key = warmup.warm_key(warmup.model_kind(open_model_file(path)), options)
    monkeypatch.setattr(warmup, "_build_command", lambda *args: [sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(warmup.PitoolsError, match=f"{path}: building the compiled kernels failed: no error recorded"):
        warmup.build_elsewhere_and_wait(path, options)
    warmup.mark_warm(key)
    monkeypatch.setattr(warmup, "_build_command", lambda *args: pytest.fail("a process started for warm kernels"))
    assert warmup.build_elsewhere_and_wait(path, options) is False


@pytest.mark.slow
def test_a_build_elsewhere_leaves_the_kernels_cached_for_the_next_process(bundled_gguf, tmp_path, monkeypatch):
    """What `pitools bench` does before its rounds, on an empty numba cache: the engines then load, not compile."""
    cold = tmp_path / "cold"
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(cold))
    monkeypatch.setattr(warmup, "marker_folder", lambda: cold)
    path = bundled_gguf("q8_0")
    assert warmup.build_elsewhere_and_wait(path, load_options(use_split=False)) is True
    code = ("from powerinfer_tools.runtime.llm import LLM; "
            f"llm = LLM.load({str(path)!r}, kernels='wait', notice=print, cache_policy='lfu'); "
            "print('compiled' if 'NumPy kernels' not in llm.description else 'reference')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "compiled" and "compiling" not in out, out
