"""The context window bounds generation: a prompt that does not fit is refused before any forward pass,
and generation stops where the window is full, on the reference engine and on the runtime alike."""

from __future__ import annotations

import numpy as np
import pytest
from cli_checks import fails
from click.testing import CliRunner

from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.commands.cli import cli
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.runtime.generation import Sampler, SamplingConfig, generate
from powerinfer_tools.runtime.llm import LLM
from powerinfer_tools.runtime.loader import load_runtime_model

GREEDY = Sampler(SamplingConfig(temperature=0))
LONG_PROMPT = "def f(x):\n    return x\n" * 40  # about 400 tokens; the bundled model has 256 positions


def counting_step(calls: list):
    def step(tokens):
        calls.append(len(tokens))
        return np.arange(5, dtype=np.float32)  # always token 4

    return step


@pytest.fixture(scope="module")
def gguf_file(bundled_gguf):
    """The bundled model as a runtime file (PowerInfer layout, no predictors: dense FFN)."""
    return bundled_gguf("f32")


# --- the generation loop ------------------------------------------------------------------------------------


def test_a_prompt_longer_than_the_window_is_refused_before_any_step():
    calls = []
    with pytest.raises(PitoolsError, match="prompt is 9 tokens; the context window holds 8"):
        generate(counting_step(calls), list(range(9)), 4, GREEDY, context_size=8)
    assert calls == []


def test_generation_stops_where_prompt_and_tokens_fill_the_window():
    calls = []
    tokens = generate(counting_step(calls), [1, 2, 3], 10, GREEDY, context_size=8)
    assert list(tokens) == [4] * 5 and tokens.stopped_at_window
    assert sum(calls) == 7  # every position the steps fed lies in the window; the last token is fed to none
    full = generate(counting_step([]), list(range(8)), 3, GREEDY, context_size=8)
    assert list(full) == [] and full.stopped_at_window
    enough = generate(counting_step([]), [1, 2, 3], 5, GREEDY, context_size=8)
    assert list(enough) == [4] * 5 and not enough.stopped_at_window  # max_tokens ended it, not the window


def test_an_empty_prompt_is_refused():
    with pytest.raises(PitoolsError, match="prompt: no tokens to start from"):
        generate(counting_step([]), [], 3, GREEDY)


# --- both engines --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["checkpoint", "gguf"])
def test_engines_refuse_a_long_prompt_and_stop_at_the_window(engine, gguf_file):
    path = BUNDLED_MODEL if engine == "checkpoint" else gguf_file
    llm = LLM.load(path)
    assert llm.context_size == 256
    with pytest.raises(PitoolsError, match=r"prompt is \d+ tokens; the context window holds 256"):
        llm.generate(LONG_PROMPT)  # at the call, before any forward pass
    whole = "".join(llm.generate("import os", max_tokens=12))
    assert not llm.last_stats.stopped_at_window
    small = LLM.load(path, ctx_size=12)
    text = "".join(small.generate("import os", max_tokens=100))
    stats = small.last_stats
    assert stats.stopped_at_window and text and whole.startswith(text)
    assert stats.prompt_tokens + stats.generated_tokens == 12


def test_the_runtime_sizes_its_buffers_by_the_window_and_refuses_positions_past_it(gguf_file):
    model = load_runtime_model(gguf_file, context_size=16)
    caches = model.new_cache()
    model.forward(np.arange(10), caches)
    decoder = model.compiled_decoder()
    if decoder is not None:  # numba present: its attention scratch holds the window, not max_positions
        assert decoder.max_context == 16
    with pytest.raises(PitoolsError, match=f"{gguf_file}: 7 tokens after 10 do not fit the context window of 16"):
        model.forward(np.arange(7), caches)
    with pytest.raises(PitoolsError, match="context size"):
        load_runtime_model(gguf_file, context_size=257)


def test_run_refuses_a_long_prompt_and_notes_a_full_window(gguf_file):
    fails("run", gguf_file, "-p", LONG_PROMPT, match="the context window holds 256")
    result = CliRunner().invoke(cli, ["run", str(gguf_file), "-p", "import os", "-c", "10", "-n", "50"])
    assert result.exit_code == 0, result.output
    note, summary = result.stderr.splitlines()
    assert note.startswith("pitools: note: stopped at the end of the context window (10 positions:")
    assert "generation:" in summary
