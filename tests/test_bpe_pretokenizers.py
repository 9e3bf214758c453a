"""Byte-level BPE tokenizers that split text with a regex before merging (Qwen2's, Llama-3's).

Each is trained here with ``tokenizers`` as the models ship it: NFC (Qwen2 only), a ``Split`` with the
model's regex, ``ByteLevel`` without a regex; special tokens appended after the vocabulary and a
non-special added token (Qwen2.5's ``<tool_call>``). A tiny checkpoint using it is converted, and three
tokenizers must agree on tricky text: ``tokenizers`` on the tokenizer.json, llama.cpp on the GGUF, and
our runtime on the GGUF.
"""

from __future__ import annotations

import json
import re
import shutil
import unicodedata
from pathlib import Path

import hf_models
import pytest
from cli_checks import fails, invoke
from gguf import TokenType
from gguf_fixtures import SAMPLE_TEXTS, llama
from powerinfer_tools.formats.model_file import open_model_file
from powerinfer_tools.formats.tokenizer_gguf import read_vocab
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from powerinfer_tools.conversion.convert import convert
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.runtime.tokenizer import GGUFTokenizer

# As the models' tokenizer.json files spell them (Qwen2/Qwen2.5, Llama-3): written out here, not taken
# from the converter, so that the converter's recognition of them is what is tested.
QWEN2_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
LLAMA3_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_TOKEN = "<tool_call>"  # added, not special: a USER_DEFINED token, split out of any text
WHOLE_WORD = "\u0120zyzzyva"  # " zyzzyva": in the vocabulary, made by no merge; only ignore_merges yields it

# tokenizer.ggml.pre -> (Split regex, NFC normalizer, BPE ignore_merges, model family)
KINDS = {
    "qwen2": (QWEN2_REGEX, True, False, "qwen2"),
    "llama-bpe": (LLAMA3_REGEX, False, True, "llama"),  # Llama-3
    "smaug-bpe": (LLAMA3_REGEX, False, False, "llama"),  # Llama-3's regex without ignore_merges
}
MODEL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
             max_position_embeddings=64)

TEXTS = SAMPLE_TEXTS + [
    "It's can't we're I've I'm we'll he'd IT'S CAN'T WE'RE I'VE 'S 'ſ x'ſ",  # contractions (ſ: no contraction)
    "12345 1 22 333 4444 55555 666666 3.14159 -0.5e10 ٣٤٥ ¹²³ ①②",  # digits: one by one, or runs of three
    "cafe\u0301 e\u0301te\u0301 A\u030a n\u0303 café \u0301x",  # accents NFC composes, a lone combining mark
    "Ωmega ﬁne ǅ Ⅻ 中文 한국어 ελληνικά",
    "a  b   c    d\t\te\n\nf\r\n\r\ng \n \n  x  \n",  # whitespace runs and newlines
    "line1\nline2\n\n\nline3\r\rx\n",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "x<|endoftext|>y <tool_call>{}</tool_call><|im_start|><|im_start|>  <|im_end|>  ",
    "\u200b\u2060\ufeff \x0b\x0c\x85\u2028 $$$ ... !!! ??? --- ___ ;; :: '''\"\"\"```",
    "hello,world.foo(bar) 😀😀 👍🏽 zyzzyva zyzzyvas",
]


def _corpus() -> list[str]:
    """Python's json package sources and the texts above, so that their characters are in the vocabulary."""
    folder = Path(json.__file__).parent
    return [p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.py"))] + TEXTS * 2


def train_split_tokenizer(folder: Path, regex: str, nfc: bool, ignore_merges: bool, vocab_size: int = 700) -> int:
    """A tokenizer.json built as Qwen2's (or Llama-3's) is; returns its size with the added tokens."""
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    spec = json.loads(tok.to_str())
    spec["model"]["vocab"][WHOLE_WORD] = len(spec["model"]["vocab"])
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_tokens([AddedToken(USER_TOKEN, special=False, normalized=False)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None if nfc else "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """pre -> (checkpoint folder, dense GGUF) of a tiny model with that kind of tokenizer."""
    root = tmp_path_factory.mktemp("split-tokenizers")
    out = {}
    for pre, (regex, nfc, ignore_merges, family) in KINDS.items():
        folder = root / pre
        n_vocab = train_split_tokenizer(folder, regex, nfc, ignore_merges)
        hf_models.build(folder, family, config_overrides=dict(MODEL, vocab_size=n_vocab + 2))
        out[pre] = folder, convert(str(folder), root / f"{pre}.gguf", outtype="f32", progress=False)[0]
    return out


def three_tokenizers(files, pre):
    folder, path = files[pre]
    metadata = open_model_file(path).metadata
    reference = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return reference, GGUFTokenizer(metadata), GGUFTokenizer(metadata, parse_special=True), llama(path, vocab_only=True)


def cpp_text(pre: str, text: str) -> bytes:
    """What llama.cpp is given for ``text``: it does not NFC-normalize, so Qwen2's text arrives normalized
    (on text NFC leaves alone, which is nearly all, the two are the same)."""
    return (unicodedata.normalize("NFC", text) if pre == "qwen2" else text).encode()


@pytest.mark.parametrize("pre", KINDS)
def test_metadata_as_llamacpp_converter_writes_it(files, pre):
    folder, path = files[pre]
    meta = open_model_file(path).metadata
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == pre
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    n = len(spec["model"]["vocab"])
    assert tokens[:n] == sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get)
    assert set(types[:n]) == {TokenType.NORMAL}
    assert tokens[n:] == SPECIALS + [USER_TOKEN, f"[PAD{n + 4}]", f"[PAD{n + 5}]"]
    assert types[n:] == [TokenType.CONTROL] * 3 + [TokenType.USER_DEFINED] + [TokenType.UNUSED] * 2
    assert meta["tokenizer.ggml.merges"] == [" ".join(m) for m in spec["model"]["merges"]]
    assert meta["tokenizer.ggml.eos_token_id"] == tokens.index("<|im_end|>")
    assert meta["tokenizer.ggml.padding_token_id"] == tokens.index("<|endoftext|>")
    assert meta.get("tokenizer.ggml.bos_token_id") == (None if pre == "qwen2" else tokens.index("<|endoftext|>"))


@pytest.mark.parametrize("pre", KINDS)
def test_token_ids_equal_tokenizers_and_llamacpp(files, pre):
    reference, ours, parsing, cpp = three_tokenizers(files, pre)
    assert any(unicodedata.normalize("NFC", text) != text for text in TEXTS)
    for text in TEXTS:
        expected = reference.encode(text, add_special_tokens=False).ids
        assert parsing.encode(text, add_bos=False) == expected, text
        assert cpp.tokenize(cpp_text(pre, text), add_bos=False, special=True) == expected, text
        # Control tokens' spellings as plain text, the other added token still split out; BOS as llama.cpp adds it.
        assert ours.encode(text) == cpp.tokenize(cpp_text(pre, text), add_bos=True, special=False), text


@pytest.mark.parametrize("pre", KINDS)
def test_decoding_matches_llamacpp_and_round_trips(files, pre):
    _, ours, _, cpp = three_tokenizers(files, pre)
    for text in TEXTS:
        ids = ours.encode(text, add_bos=False)
        assert ours.decode(ids).encode() == cpp.detokenize(ids) == cpp_text(pre, text), text


def test_qwen2_splits_digits_one_by_one_llama3_in_threes(files):
    for pre, groups in (("qwen2", ["1", "2", "3", "4", "5"]), ("llama-bpe", ["123", "45"])):
        reference, ours, _, _ = three_tokenizers(files, pre)
        assert [piece for piece, _ in reference.pre_tokenizer.pre_tokenize_str("12345")] == groups
        pieces = [ours.decode([i]) for i in ours.encode("12345", add_bos=False)]
        ends = {sum(len(p) for p in pieces[: k + 1]) for k in range(len(pieces))}
        assert "".join(pieces) == "12345" and {len("".join(groups[: k + 1])) for k in range(len(groups))} <= ends


def test_ignore_merges_keeps_a_whole_word_token(files):
    """Llama-3 ("llama-bpe") takes a piece that is a token whole; without ignore_merges it is merged."""
    for pre in KINDS:
        _, ours, _, cpp = three_tokenizers(files, pre)
        ids = ours.encode(" zyzzyva", add_bos=False)
        assert (ids == [ours.ids[WHOLE_WORD]]) == (pre == "llama-bpe"), pre
        assert ids == cpp.tokenize(b" zyzzyva", add_bos=False, special=False)


def test_bos_as_llamacpp_adds_it(files):
    """llama.cpp starts Llama-3 prompts with BOS unless the file says otherwise; Qwen2's with none."""
    for pre in KINDS:
        _, ours, _, cpp = three_tokenizers(files, pre)
        assert ours.encode("hi") == cpp.tokenize(b"hi", add_bos=True, special=False)
        assert (ours.encode("hi")[0] == ours.bos_token_id) == (pre == "llama-bpe")


def _tokenizer_copy(tmp_path: Path, files, pre: str, edit) -> Path:
    """A copy of a checkpoint folder with its tokenizer.json edited."""
    folder = tmp_path / pre
    shutil.copytree(files[pre][0], folder)
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    edit(spec)
    (folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    return folder


def _split(spec: dict) -> dict:
    return spec["pre_tokenizer"]["pretokenizers"][0]


@pytest.mark.parametrize(
    "pre, edit, message",
    [
        ("qwen2", lambda s: _split(s)["pattern"].update(Regex=r"\p{N}{1,2}|\p{L}+|\s+|."), "is not one llama.cpp has"),
        ("qwen2", lambda s: s.update(normalizer=None), "normalizer none (Qwen2's has NFC)"),
        ("qwen2", lambda s: s.update(normalizer={"type": "NFKC"}), "normalizer NFKC"),
        ("llama-bpe", lambda s: s.update(normalizer={"type": "NFC"}), "normalizer NFC (Llama-3's has none)"),
        ("qwen2", lambda s: s["model"].update(ignore_merges=True), "ignore_merges true"),
        ("qwen2", lambda s: s["model"].update(byte_fallback=True), "BPE option byte_fallback"),
        ("qwen2", lambda s: s["pre_tokenizer"]["pretokenizers"][1].update(use_regex=True), "cannot embed this tokenizer"),
    ],
)
def test_tokenizers_llamacpp_would_read_otherwise_are_refused(tmp_path, files, pre, edit, message):
    folder = _tokenizer_copy(tmp_path, files, pre, edit)
    with pytest.raises(PitoolsError, match=re.escape(message)) as error:
        read_vocab(folder, 10_000)
    assert str(folder / "tokenizer.json") in str(error.value)


def test_convert_refuses_an_unknown_split_regex(tmp_path, files):
    folder = _tokenizer_copy(tmp_path, files, "qwen2", lambda s: _split(s)["pattern"].update(Regex=r"\w+|\s+|."))
    out = tmp_path / "m.gguf"
    fails("convert", folder, "-o", out, match="is not one llama.cpp has a pre-tokenizer for", names=folder / "tokenizer.json")
    assert not out.exists()


def test_pitools_converts_and_runs_a_qwen2_checkpoint(tmp_path, files):
    folder, _ = files["qwen2"]
    out = tmp_path / "qwen2.gguf"
    result = invoke("convert", folder, "-o", out)
    assert result.exit_code == 0, result.stderr
    prompt = "<|im_start|>user\nCafe\u0301 12345, it's\n"
    result = invoke("run", out, "--temp", "0", "-p", prompt, "-n", "8")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith(prompt)
    n_prompt = len(llama(out, vocab_only=True).tokenize(cpp_text("qwen2", prompt), add_bos=True, special=False))
    assert f"prompt: {n_prompt} tokens" in result.stderr
