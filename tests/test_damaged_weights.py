"""A model file whose weights hold NaN or infinity: one error line naming the file and the tensor on every command
that runs it (run, perplexity, serve, bench), on the compiled decoder and the NumPy kernels alike. The norms the
loader copies are checked at load; a matrix when the logits it spoils are not finite (``RuntimeModel.forward``)."""

from __future__ import annotations

import functools
import re
import shutil

import numpy as np
import pytest
from cli_checks import fails
from gguf_fixtures import rewrite_gguf

from powerinfer_tools.benchmarking.bench import DENSE, BenchSettings, run_bench
from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.conversion.convert import convert
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.model_file import open_model_file
from powerinfer_tools.formats.safetensors_file import NonFiniteTensor
from powerinfer_tools.runtime import warmup
from powerinfer_tools.runtime.llm import LLM
from powerinfer_tools.runtime.loader import load_runtime_model

# A layer's attention output, which every token reads whole: its NaN reaches the next layer's RMS norm, the logits
# after it. (A sparse FFN reads only the rows of the neurons its tokens keep: a NaN in a row none keeps is never read.)
MATRIX = "blk.1.attn_output.weight"


def poisoned(data: np.ndarray, value: float) -> np.ndarray:
    """A copy of a tensor's stored ``data`` with one value ``value``: a float's, or a q8_0 block's scale (its first
    two bytes, float16), which makes the block's 32 values NaN or infinite."""
    data = np.array(data)
    if data.dtype == np.uint8:
        data[3, :2] = np.array([value], dtype=np.float16).view(np.uint8)
    else:
        data.reshape(-1)[7] = value
    return data


# The files damaged: llama.cpp's layout (where the compiled decoder's ZeroDivisionError was found), and PowerInfer's.
LAYOUTS = {"dense f16": ("f16", True), "powerinfer q8_0": ("q8_0", False)}


@pytest.fixture(scope="module")
def intact(bundled_gguf, tmp_path_factory):
    """(outtype, dense) -> the bundled model converted so, its kind's kernels compiled: a damaged copy's run, which
    fails at its first logits, then prints its error alone, not after the notice of a compilation."""
    root = tmp_path_factory.mktemp("intact")

    @functools.cache
    def warm(outtype: str, dense: bool = False):
        path = (convert(str(BUNDLED_MODEL), root / f"m.{outtype}.gguf", outtype=outtype, dense=True, progress=False)[0]
                if dense else bundled_gguf(outtype))
        LLM.load(path, kernels="wait")
        return path

    return warm


@pytest.fixture
def damaged(intact, tmp_path):
    """``(tensor, value, layout)`` -> a copy of ``intact(*layout)`` whose ``tensor`` holds ``value``."""

    def make(name: str, value: float = np.nan, layout: tuple[str, bool] = LAYOUTS["dense f16"]):
        path = tmp_path / "damaged.gguf"
        shutil.copyfile(intact(*layout), path)
        rewrite_gguf(path, {}, {name: poisoned(open_model_file(path)[name].data, value)})
        return path

    return make


def named(name: str, count: int = 1) -> str:
    return f"tensor {name} has {count} non-finite values (NaN/inf)"


@pytest.mark.parametrize("kernels", ["wait", "reference"])  # the compiled decoder, the NumPy kernels
@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_run_names_the_tensor(damaged, layout, kernels, value):
    # On the dense file the compiled decoder's fast RMS norm had turned the NaN into a 0 divisor: a
    # ZeroDivisionError traceback.
    path = damaged(MATRIX, value, LAYOUTS[layout])
    count = 32 if layout.endswith("q8_0") else 1  # a q8_0 block's scale: its 32 values
    fails("run", path, "-p", "def ", "-n", "3", "--kernels", kernels, match=named(MATRIX, count), names=path)


def test_a_norm_is_refused_at_load(damaged):
    path = damaged("blk.0.attn_norm.weight")
    with pytest.raises(NonFiniteTensor, match=re.escape(f"{path}: {named('blk.0.attn_norm.weight')}")):
        load_runtime_model(path)


def test_a_warm_up_compiles_a_damaged_file_whose_first_step_is_refused(damaged):
    engine = load_runtime_model(damaged(MATRIX))
    warmup.exercise(engine)  # compiling needs no finite values: the kind's kernels are built and marked alike
    with pytest.raises(NonFiniteTensor, match=re.escape(named(MATRIX))):
        engine.step_fn()(np.array([1, 2]))


def test_perplexity_names_the_tensor(damaged):
    # It printed "perplexity nan", exit status 0.
    path = damaged(MATRIX)
    fails("perplexity", path, "--corpus", BUNDLED_MODEL / "heldout.txt", "--tokens", "64", "-q", match=named(MATRIX),
          names=path)


def test_serve_refuses_before_listening(damaged, monkeypatch):
    def served(app):
        raise AssertionError("the server started")

    monkeypatch.setattr("powerinfer_tools.serving.uvicorn_server.http_server", served)
    path = damaged(MATRIX)
    fails("serve", path, "--port", "0", match=named(MATRIX), names=path)


def test_bench_names_the_tensor(damaged):
    path = damaged(MATRIX)
    with pytest.raises(PitoolsError, match=re.escape(f"{path}: {named(MATRIX)}")):
        run_bench(path, None, BenchSettings(prompt_tokens=8, generate=3, runs=1, threads=1), modes=(DENSE,))


def test_logits_that_overflow_from_finite_weights_are_one_error_line(intact, tmp_path):
    """No tensor to name: the error says the weights are finite, and what else spoils logits."""
    path = tmp_path / "overflowing.gguf"
    shutil.copyfile(intact("f32"), path)
    norm = open_model_file(path)["output_norm.weight"].data
    rewrite_gguf(path, {}, {"output_norm.weight": np.full_like(norm, 3e38)})
    fails("run", path, "-p", "def ", "-n", "3", match="logits are not finite (NaN or infinity), though every weight "
          "in the file is", names=path)
