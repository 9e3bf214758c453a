"""The runtime's tokenizer, read from GGUF metadata, against llama.cpp on the same file."""

from __future__ import annotations

import re
import shutil

import pytest
from cli_checks import fails
from gguf_fixtures import EOT, SAMPLE_TEXTS, llama, rewrite_gguf
from powerinfer_tools.formats.model_file import open_model_file

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.runtime.tokenizer import GGUFTokenizer


def ours_and_llamacpp(path):
    """Our tokenizer and llama.cpp's, both read from the GGUF file at ``path``."""
    return GGUFTokenizer(open_model_file(path).metadata), llama(path, vocab_only=True)


@pytest.mark.parametrize("kind", ["gpt2", "spm"])
def test_token_ids_equal_llamacpp(tokenizer_models, kind):
    ours, cpp = ours_and_llamacpp(tokenizer_models[kind][1])
    for text in SAMPLE_TEXTS:
        assert ours.encode(text, add_bos=False) == cpp.tokenize(text.encode(), add_bos=False, special=False), text
        assert ours.encode(text) == cpp.tokenize(text.encode(), add_bos=True, special=False), text


@pytest.mark.parametrize("kind", ["gpt2", "spm"])
def test_decoding_matches_llamacpp_and_round_trips(tokenizer_models, kind):
    ours, cpp = ours_and_llamacpp(tokenizer_models[kind][1])
    for text in SAMPLE_TEXTS:
        ids = cpp.tokenize(text.encode(), add_bos=False, special=False)
        assert ours.decode(ids).encode() == cpp.detokenize(ids), text
        if kind == "gpt2":  # byte-level BPE is lossless; SentencePiece adds its leading space
            assert ours.decode(ids) == text


def test_unknown_tokenizer_kind_is_named():
    with pytest.raises(PitoolsError, match="'bert' is not supported"):
        GGUFTokenizer({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})


def test_a_bpe_vocabulary_without_merges_is_refused_as_llamacpp_refuses_it(tokenizer_models, tmp_path):
    """Merged by no merges, text was tokenized a character at a time."""
    path = tmp_path / "no-merges.gguf"
    shutil.copyfile(tokenizer_models["gpt2"][1], path)
    rewrite_gguf(path, {"tokenizer.ggml.merges": None})
    with pytest.raises(ValueError, match="Failed to load model"):  # "cannot find tokenizer merges in model file"
        llama(path, vocab_only=True)
    missing = "tokenizer.ggml.merges must hold merges (a gpt2 vocabulary is merged by them"
    fails("run", path, "-p", "def ", "-n", "1", match=missing, names=path)
    with pytest.raises(PitoolsError, match=re.escape(f"{path}: {missing}")):
        GGUFTokenizer(open_model_file(path).metadata, source=str(path))


@pytest.mark.parametrize("kind", ["gpt2", "spm"])
def test_special_token_spellings_parse_as_llamacpp_does(tokenizer_models, kind):
    _, path = tokenizer_models[kind]
    metadata = open_model_file(path).metadata
    ours, parsing = GGUFTokenizer(metadata), GGUFTokenizer(metadata, parse_special=True)
    cpp = llama(path, vocab_only=True)
    special = EOT if kind == "gpt2" else "</s>"
    texts = [f"a{special}b", f"{special} x {special}{special}  y", f"def f():\n{special}\n\"\"\"doc", special, f" {special}"]
    for text in texts:
        assert parsing.encode(text) == cpp.tokenize(text.encode(), add_bos=True, special=True), text
        assert ours.encode(text) == cpp.tokenize(text.encode(), add_bos=True, special=False), text
    assert parsing.encode(texts[0], add_bos=False).count(parsing.ids[special]) == 1
