"""Gemma 2 against transformers (eager attention, the one implementation that soft-caps) on the small random
checkpoint of tests/family_checkpoints.py (``FAMILIES["gemma2"]``: a window of 8 keys in its sliding layer, caps of 5
on the scores and 3 on the logits): our reference engine and our runtime, on the file llama.cpp's converter writes
and on ours, decode the same greedy tokens, the prompt as one block (the compiled prompt attention), then one token
at a time (the compiled decoder, or the general path). The caps and the window change the logits far beyond the
tolerance, so an engine that ignored one could not pass. tests/test_families.py and tests/test_family_oracles.py
run the family's shared checks (llama.cpp against transformers, perplexity, conversions both ways); what Gemma 2
has no GGUF layout for is refused, with one line."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import transformers
from family_checkpoints import FAMILIES, GEMMA2_WINDOW
from gguf_fixtures import rewrite_gguf
from oracle_decoding import (
    F32_ERROR,
    STEPS,
    agreeing_prefix,
    llamacpp_logits_and_greedy,
    prompt_ids,
    relative_error,
    transformers_greedy,
    transformers_logits,
)
from runtime_decoding import runtime_logits_and_greedy

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.conversion.convert import convert
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.models import load_model, spec_from_config
from powerinfer_tools.runtime.loader import load_runtime_model

CONFIG = FAMILIES["gemma2"].config


@pytest.fixture(scope="module")
def gemma2(family_checkpoint, llamacpp_gguf, tmp_path_factory):
    """(the checkpoint, llama.cpp's converter's f32 file of it, our converter's, the prompt ids, transformers'
    logits of the prompt and its greedy continuation)."""
    built, theirs = family_checkpoint("gemma2"), llamacpp_gguf("gemma2")
    ours, _ = convert(str(built.folder), tmp_path_factory.mktemp("gemma2") / "ours.gguf", outtype="f32", dense=True,
                      progress=False)
    ids = prompt_ids(theirs)
    assert len(ids) > 10 * GEMMA2_WINDOW
    return built, {"llama.cpp's": theirs, "ours": ours}, ids, transformers_logits(built.reference, ids), \
        transformers_greedy(built.reference, ids, STEPS)


def test_the_caps_and_the_window_change_the_logits_far_beyond_the_tolerance(gemma2):
    built, _, ids, logits, greedy = gemma2
    assert len(set(greedy)) > STEPS // 2, greedy
    assert np.abs(logits).max() < CONFIG["final_logit_softcapping"]
    for change in ({"attn_logit_softcapping": None}, {"final_logit_softcapping": None},
                   {"sliding_window": 4 * len(ids)}):
        changed = transformers.AutoModelForCausalLM.from_pretrained(built.folder, dtype=torch.float32,
                                                                    attn_implementation="eager", **change).eval()
        assert relative_error(transformers_logits(changed, ids), logits) > 100 * F32_ERROR, change


def test_the_reference_engine_decodes_as_transformers(gemma2):
    built, _, ids, logits, greedy = gemma2
    model = load_model(Checkpoint(built.folder))
    cache = model.new_cache()
    ours = model.forward(np.array(ids), cache)
    assert relative_error(ours.astype(np.float64), logits) < F32_ERROR
    tokens = []
    for _ in range(STEPS):
        tokens.append(int(ours[-1].argmax()))
        ours = model.forward(np.array(tokens[-1:]), cache)
    assert tokens == greedy, f"the same for {agreeing_prefix(tokens, greedy)} tokens"


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-decoder", "general-path"])
@pytest.mark.parametrize("file", ["llama.cpp's", "ours"])
def test_the_runtime_decodes_as_transformers(gemma2, file, compiled):
    """The prompt's logits (its last tokens one at a time) within F32_ERROR of transformers' (its final cap
    included), and the greedy continuation transformers decodes."""
    _, files, ids, logits, greedy = gemma2
    ours, tokens, model = runtime_logits_and_greedy(files[file], ids, compiled)
    assert model.layer_paths() == (["compiled decoder" if compiled else "general path (compiled decoding turned off)"]
                                   * CONFIG["num_hidden_layers"])
    assert relative_error(ours, logits) < F32_ERROR
    assert tokens == greedy, f"the same for {agreeing_prefix(tokens, greedy)} tokens"


def test_a_file_without_the_cap_keys_is_capped_as_llamacpp_caps_it(gemma2, tmp_path):
    """llama.cpp's gemma2 caps at 50 and 30 where a file says nothing: so does the runtime, and computes what
    llama.cpp computes on that file."""
    _, files, ids, _, _ = gemma2
    path = tmp_path / "uncapped-keys.gguf"
    path.write_bytes(files["llama.cpp's"].read_bytes())
    rewrite_gguf(path, {"gemma2.attn_logit_softcapping": None, "gemma2.final_logit_softcapping": None})
    model = load_runtime_model(path)
    assert (model.spec.attn_logit_softcapping, model.spec.final_logit_softcapping) == (50.0, 30.0)
    theirs, _ = llamacpp_logits_and_greedy(path, ids, 0)
    ours = model.forward(np.array(ids), model.new_cache()).astype(np.float64)
    assert relative_error(ours, theirs) < FAMILIES["gemma2"].llamacpp_error


def released_config(folder, **changes) -> dict:
    return json.loads((folder / "config.json").read_text()) | changes


@pytest.mark.parametrize("changes, message", [
    ({"hidden_activation": "gelu"}, "gemma2 models with hidden_activation='gelu' are not supported"),
    ({"tie_word_embeddings": False}, "gemma2 models with untied embeddings are not supported"),
    ({"use_bidirectional_attention": True}, "gemma2 models with use_bidirectional_attention are not supported"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "(the only arrangement supported)"),
])
def test_what_the_engines_do_not_compute_is_refused(family_checkpoint, changes, message):
    with pytest.raises(PitoolsError, match=re.escape(message)):
        spec_from_config(released_config(family_checkpoint("gemma2").folder, **changes))


@pytest.mark.parametrize("changes, message", [
    ({"query_pre_attn_scalar": 24}, "a gemma2 model with query_pre_attn_scalar 24.0 has no GGUF layout: llama.cpp's "
                                    "gemma2 assumes 32"),
    ({"attn_logit_softcapping": None}, "a gemma2 model without attn_logit_softcapping has no GGUF layout"),
    ({"sliding_window": None}, "a gemma2 model without a sliding window has no GGUF layout"),
])
def test_what_llamacpps_gemma2_cannot_hold_is_not_converted(family_checkpoint, tmp_path, changes, message):
    folder = tmp_path / "model"
    folder.mkdir()
    for item in family_checkpoint("gemma2").folder.iterdir():
        (folder / item.name).symlink_to(item)
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(released_config(family_checkpoint("gemma2").folder, **changes)))
    with pytest.raises(PitoolsError, match=re.escape(message)):
        convert(str(folder), tmp_path / "m.gguf", outtype="f32", dense=True, progress=False)
