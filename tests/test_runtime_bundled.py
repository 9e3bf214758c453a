"""The runtime on the bundled model: quantized files against f32, and greedy generation."""

from __future__ import annotations

import numpy as np
import pytest

from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.checkpoints.tokenizer import CheckpointTokenizer
from powerinfer_tools.profiling.corpus import read_tokens, resolve_source
from powerinfer_tools.runtime.generation import SamplingConfig
from powerinfer_tools.runtime.llm import LLM
from powerinfer_tools.runtime.loader import load_runtime_model

pytestmark = pytest.mark.slow
HELDOUT_TOKENS = 512
GREEDY = SamplingConfig(temperature=0)


@pytest.fixture(scope="module")
def files(bundled_gguf):
    return {t: bundled_gguf(t) for t in ("f32", "q8_0", "q4_0")}


def top1(path, tokens) -> np.ndarray:
    model = load_runtime_model(path)
    window = model.spec.max_positions
    return np.concatenate([model.forward(tokens[s : s + window], model.new_cache()).argmax(-1)
                           for s in range(0, len(tokens), window)])


@pytest.mark.parametrize("outtype,minimum", [("q8_0", 0.97), ("q4_0", 0.85)])
def test_quantized_top1_agreement_on_heldout_text(files, outtype, minimum):
    tokenizer = CheckpointTokenizer(BUNDLED_MODEL, 0, 0)
    tokens = read_tokens(resolve_source((), None, BUNDLED_MODEL), tokenizer, HELDOUT_TOKENS)
    agreement = float(np.mean(top1(files[outtype], tokens) == top1(files["f32"], tokens)))
    print(f"{outtype}: top-1 agreement with f32 over {len(tokens)} held-out tokens: {agreement:.4f}")
    assert agreement >= minimum  # measured: q8_0 0.996, q4_0 0.895


def test_greedy_generation_is_stable_and_matches_the_reference_engine(files):
    reference = "".join(LLM.load(BUNDLED_MODEL).generate("import os\n", 24, GREEDY))
    runs = ["".join(LLM.load(files["f32"], mode="dense").generate("import os\n", 24, GREEDY)) for _ in range(2)]
    assert runs[0] == runs[1] == reference
