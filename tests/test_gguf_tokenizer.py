"""The tokenizer embedded in GGUF: llama.cpp must tokenize as the original tokenizers tokenizer does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf import TokenType
from gguf_fixtures import EOT, SAMPLE_TEXTS, llama, train_gpt2_tokenizer
from powerinfer_tools.formats.model_file import open_model_file
from powerinfer_tools.formats.tokenizer_gguf import read_vocab
from tokenizers import Tokenizer

from powerinfer_tools.errors import PitoolsError


@pytest.mark.parametrize("kind", ["gpt2", "spm"])
def test_llamacpp_tokenizes_like_tokenizers(tokenizer_models, kind):
    folder, path = tokenizer_models[kind]
    reference = Tokenizer.from_file(str(folder / "tokenizer.json"))
    cpp = llama(path, vocab_only=True)
    for text in SAMPLE_TEXTS:
        expected = reference.encode(text, add_special_tokens=False).ids
        assert cpp.tokenize(text.encode(), add_bos=False, special=False) == expected, text


def test_special_tokens_and_bos(tokenizer_models):
    folder, path = tokenizer_models["gpt2"]
    cpp = llama(path, vocab_only=True)
    assert cpp.token_bos() == cpp.token_eos() == 0
    text = f"{EOT}def main():{EOT}"
    expected = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids
    assert expected[0] == expected[-1] == 0
    assert cpp.tokenize(text.encode(), add_bos=True, special=True) == expected  # add_bos_token is false
    spm = llama(tokenizer_models["spm"][1], vocab_only=True)
    assert spm.tokenize(b"hi", add_bos=True)[0] == 1  # LLaMA style: add_bos_token true, <s> is 1


def test_gpt2_metadata(tokenizer_models):
    folder, path = tokenizer_models["gpt2"]
    meta = open_model_file(path).metadata
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "gpt-2"
    n = len(vocab["vocab"])
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == n + 3 == meta["llama.vocab_size"]
    assert tokens[0] == EOT and types[0] == TokenType.CONTROL
    assert tokens[n:] == [f"[PAD{i}]" for i in range(n, n + 3)] and set(types[n:]) == {TokenType.UNUSED}
    assert all(tokens[i] == t and types[i] == TokenType.NORMAL for t, i in vocab["vocab"].items() if i > 0)
    assert meta["tokenizer.ggml.merges"] == [" ".join(m) for m in vocab["merges"]]
    assert meta["tokenizer.ggml.bos_token_id"] == meta["tokenizer.ggml.eos_token_id"] == 0
    assert meta["tokenizer.ggml.add_bos_token"] is False


def test_spm_metadata(tokenizer_models):
    folder, path = tokenizer_models["spm"]
    meta = open_model_file(path).metadata
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    tokens, types, scores = (meta[f"tokenizer.ggml.{k}"] for k in ("tokens", "token_type", "scores"))
    assert meta["tokenizer.ggml.model"] == "llama" and "tokenizer.ggml.pre" not in meta
    assert meta["tokenizer.ggml.add_space_prefix"] is True
    assert types[:3] == [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    assert tokens[3:259] == [f"<0x{b:02X}>" for b in range(256)] and set(types[3:259]) == {TokenType.BYTE}
    # A merged token scores minus the rank of the merge that makes it: earlier merges win.
    first, second = spec["merges"][0], spec["merges"][1]
    assert scores[tokens.index("".join(first))] == 0.0
    assert scores[tokens.index("".join(second))] == -1.0


@pytest.mark.parametrize("scheme, expected", [("first", True), ("always", True), ("never", False)])
def test_metaspace_space_prefix(tmp_path, tokenizer_models, scheme, expected):
    spec = json.loads((tokenizer_models["spm"][0] / "tokenizer.json").read_text(encoding="utf-8"))
    spec["normalizer"] = None
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": scheme, "split": False}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    vocab = read_vocab(tmp_path, len(spec["model"]["vocab"]))
    assert (vocab.model, vocab.add_space_prefix) == ("llama", expected)


def _edited(tmp_path: Path, edit) -> Path:
    train_gpt2_tokenizer(tmp_path, vocab_size=300)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    edit(spec)
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    return tmp_path


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s["pre_tokenizer"].update(add_prefix_space=True), "cannot embed this tokenizer"),
        (lambda s: s["model"].update(type="WordPiece"), "model WordPiece"),
        (lambda s: s.update(normalizer={"type": "NFKC"}), "normalizer NFKC"),
        (lambda s: s["added_tokens"].append(dict(s["added_tokens"][0], id=299, content="a")), "appears twice"),
        (lambda s: s["model"].update(merges=[]), "a byte-level BPE tokenizer without merges cannot be embedded"),
    ],
)
def test_tokenizers_that_cannot_be_embedded(tmp_path, edit, message):
    folder = _edited(tmp_path, edit)
    with pytest.raises(PitoolsError, match=message):
        read_vocab(folder, 300)


def test_vocabulary_larger_than_the_embedding(tmp_path):
    train_gpt2_tokenizer(tmp_path, vocab_size=300)
    with pytest.raises(PitoolsError, match="only 200 rows"):
        read_vocab(tmp_path, 200)
