"""The runtime's tokenizer, read from GGUF metadata, against llama.cpp on the same file."""

from __future__ import annotations

import pytest
from gguf_fixtures import EOT, SAMPLE_TEXTS, llama
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
