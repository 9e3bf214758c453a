"""Shared helpers for the conversion tests: small tokenizers trained with ``tokenizers``, small
checkpoints that use them, predictor folders, and llama-cpp-python set up for this machine."""

from __future__ import annotations

import json
from pathlib import Path

import hf_models
import numpy as np
from cli_checks import invoke
from safetensors.numpy import save_file
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from powerinfer_tools.benchmarking.llamacpp import load_llama_cpp as llama  # noqa: F401 - the tests' name for it
from powerinfer_tools.predictors.trainer import TrainSettings

EOT = "<|endoftext|>"
SPM_SPECIALS = ["<unk>", "<s>", "</s>"]

# Text llama.cpp must tokenize exactly as tokenizers does: code, Unicode, whitespace runs.
SAMPLE_TEXTS = [
    "def f(x):\n    return x  +  1  # héllo wörld ✓ 日本語\n\n\t  tabs\r\nend",
    'import json\nclass JSONDecoder(object):\n    """Simple JSON <https://json.org> decoder"""\n',
    "   leading spaces and trailing   ",
    "emoji 😀🚀 and ZWJ 👨\u200d👩\u200d👧 mixed Ünïcödé",
    "a\u00a0b\u2003c\u3000d",
    "\n\n\n",
    " ",
    "x" * 50,
    "1234567890 3.14159 -42 0x1F",
    "Ελληνικά Русский عربى हिन्दी",
    "can't won't I'm we'll they've she'd",
]


def training_texts() -> list[str]:
    """The json package's sources (on every Python) plus some non-ASCII text."""
    folder = Path(json.__file__).parent
    texts = [p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.py"))]
    return texts + ["héllo wörld — café naïve 日本語 テキスト ✓ ünïcödé Ελληνικά Русский " * 3]


def train_gpt2_tokenizer(folder: Path, vocab_size: int = 500) -> int:
    """GPT-2 byte-level BPE as the bundled model's: <|endoftext|> is id 0, BOS and EOS. Returns the vocab size."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(training_texts(), trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": EOT, "eos_token": EOT, "add_bos_token": False, "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


def train_spm_tokenizer(folder: Path, vocab_size: int = 600) -> int:
    """A LLaMA-2-style tokenizer.json: BPE with byte fallback, spaces as U+2581 through a
    Prepend+Replace normalizer, <unk> <s> </s> then the 256 <0xXX> byte tokens first."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPM_SPECIALS, limit_alphabet=120, show_progress=False
    )
    tok.train_from_iterator(training_texts(), trainer=trainer)
    # tokenizers cannot train byte tokens into the model vocabulary: renumber with them inserted.
    spec = json.loads(tok.to_str())
    trained = [t for t, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1]) if t not in SPM_SPECIALS]
    order = SPM_SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + trained
    spec["model"]["vocab"] = {t: i for i, t in enumerate(order)}
    for added in spec["added_tokens"]:
        added["id"] = spec["model"]["vocab"][added["content"]]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return len(order)


def make_model(folder: Path, family: str, tokenizer: str = "gpt2", *, extra_vocab: int = 0, build_kwargs=None, **config):
    """A small random checkpoint with a trained tokenizer; returns the transformers model (float32).

    ``extra_vocab`` pads the embedding beyond the tokenizer, as many released models do.
    """
    train = train_gpt2_tokenizer if tokenizer == "gpt2" else train_spm_tokenizer
    n_vocab = train(folder)
    config = dict(config, vocab_size=n_vocab + extra_vocab)
    return hf_models.build(folder, family, config_overrides=config, **(build_kwargs or {}))


# The 2-layer ReLU LLaMA the error-contract tests convert and damage (make_model gives it its vocabulary).
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
             max_position_embeddings=32, hidden_act="relu")
# Predictor training cut short: these tests check the pipeline, not how well predictors predict.
FAST_TRAINING = TrainSettings(epochs=1, min_epoch_steps=20, batch_size=64, min_precision=0.0)


def write_code_corpus(path: Path) -> Path:
    """A profiling corpus: the json package's sources (on every Python) in one text file."""
    path.write_text("\n\n".join(p.read_text() for p in sorted(Path(json.__file__).parent.glob("*.py"))))
    return path


TOKENIZER_TEST_MODEL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=2, max_position_embeddings=64, hidden_act="silu")


def build_tokenizer_models(root: Path) -> dict[str, tuple[Path, Path]]:
    """kind -> (checkpoint folder, dense GGUF) for a tiny model with a GPT-2 ("gpt2") and a
    LLaMA-style ("spm") tokenizer; the GPT-2 one pads its vocabulary with 3 unused tokens."""
    from powerinfer_tools.conversion.convert import convert

    out = {}
    for kind, extra in (("gpt2", 3), ("spm", 0)):
        folder = root / kind
        make_model(folder, "llama", kind, extra_vocab=extra, **TOKENIZER_TEST_MODEL)
        path, _ = convert(str(folder), root / f"{kind}.gguf", progress=False)
        out[kind] = folder, path
    return out


def save_predictors(folder: Path, layers: list[tuple[np.ndarray, np.ndarray]], sparse_threshold: float | None = 0.0,
                    complete: bool = True) -> None:
    """A predictor folder in the layout `pitools train-predictors` writes (formats/README.md)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i, (fc1, fc2) in enumerate(layers):
        tensors[f"blk.{i}.fc1.weight"] = np.ascontiguousarray(fc1)
        tensors[f"blk.{i}.fc2.weight"] = np.ascontiguousarray(fc2)
    save_file(tensors, str(folder / "predictors.safetensors"))
    finished = [{"layer": i, "hidden": fc1.shape[0], "recall": 0.99, "precision": 0.5, "predicted_density": 0.2,
                 "true_density": 0.1, "bytes": fc1.nbytes + fc2.nbytes} for i, (fc1, fc2) in enumerate(layers)]
    n_layers = len(layers) + (0 if complete else 1)
    meta = {"format": "pitools-predictors", "version": 1, "complete": complete, "n_layers": n_layers,
            "ffn_params": 1, "settings": {"recall": 0.99, "budget": 0.1}, "layers": finished}
    if sparse_threshold is not None:
        meta["sparse_threshold"] = sparse_threshold
    (folder / "predictors.json").write_text(json.dumps(meta))


def random_predictors(n_layers: int, d_model: int, d_ff: int, hidden: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((hidden, d_model)).astype(np.float32), rng.standard_normal((d_ff, hidden)).astype(np.float32))
        for _ in range(n_layers)
    ]


def rope_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """Where llama.cpp's stored q/k row r comes from, written out longhand (independent of the converter)."""
    head_dim = n_rows // n_heads
    order = []
    for h in range(n_heads):
        for i in range(head_dim // 2):
            order += [h * head_dim + i, h * head_dim + head_dim // 2 + i]
    return np.array(order)


# --- llama.cpp's quantizer -------------------------------------------------------------------------

# llama.cpp's file types whose weights the runtime computes (formats/weight_types.py), as its quantizer names them
# (llama_cpp.LLAMA_FTYPE_MOSTLY_*); the k-quant mixes and IQ4_XS need rows of whole 256-value super-blocks.
LLAMA_FILE_TYPES = ("Q4_1", "Q5_0", "Q5_1", "Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K", "IQ4_NL", "IQ4_XS", "IQ3_M",
                    "TQ1_0", "TQ2_0", "BF16")


def llama_quantize(source: Path, out: Path, file_type: str, requantize: bool = False) -> Path:
    """``source`` (a GGUF file) written to ``out`` by llama.cpp's own quantizer as ``file_type`` (its name after
    ``LLAMA_FTYPE_MOSTLY_``: ``Q4_K_M``, ``Q8_0``); ``requantize``: from a quantized ``source``."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}")
    params.allow_requantize = requantize
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) == 0
    return out


# --- comparing logits ----------------------------------------------------------------------------

TOKENS = np.array([5, 17, 3, 99, 42, 7, 7, 1, 60, 23, 11])


def relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    """Largest absolute difference relative to the reference's largest magnitude."""
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def stepwise_logits(model, tokens=TOKENS, prompt=4) -> np.ndarray:
    """Logits of every position, the prompt as one block and the rest one token at a time."""
    caches = model.new_cache()
    steps = [model.forward(tokens[:prompt], caches)]
    steps += [model.forward(tokens[i : i + 1], caches) for i in range(prompt, len(tokens))]
    return np.concatenate(steps)


# --- perplexity against llama.cpp's, on a real model's file ---------------------------------------------------

EVAL_TOKENS, EVAL_SEQ_LEN = 4096, 512  # held-out tokens scored, in windows of this many
PERPLEXITY_BOUND = 0.01  # the issue's: ours within 1% of llama.cpp's on the same file


def llamacpp_perplexity(path: Path, tokens: np.ndarray, seq_len: int) -> float:
    """llama.cpp's perplexity with ``pitools perplexity``'s windows: each ``seq_len`` inputs from an empty
    cache, scored on the tokens one further on (f32 KV cache: its f16 default rounds what ours does not)."""
    cpp = llama(path, n_ctx=seq_len, n_batch=seq_len, logits_all=True, n_threads=2, type_k=0, type_v=0)
    nll, scored = 0.0, 0
    for start in range(0, len(tokens) - 1, seq_len):
        targets = tokens[start + 1 : start + seq_len + 1]
        cpp.reset()
        cpp.eval(tokens[start : start + len(targets)].tolist())
        logits = np.array(cpp.scores[: len(targets)], dtype=np.float64)
        peak = logits.max(axis=1)
        log_norm = np.log(np.exp(logits - peak[:, None]).sum(axis=1)) + peak
        nll += float((log_norm - logits[np.arange(len(targets)), targets]).sum())
        scored += len(targets)
    return float(np.exp(nll / scored))


def our_perplexity(path: Path, corpus: Path) -> float:
    result = invoke("perplexity", path, "--corpus", corpus, "--tokens", EVAL_TOKENS, "--seq-len", EVAL_SEQ_LEN,
                    "--json", "-q")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["perplexity"]


# --- rewriting a model or split file ------------------------------------------------------------------------

def rewrite_gguf(path: Path, changes: dict, tensors: dict | None = None, add_tensors: dict | None = None) -> None:
    """Rewrite the model or split file ``path`` in place with its metadata changed: ``changes`` maps a key to
    ``(value, GGUFValueType[, item type])`` (a new value, of any type) or to None (the key removed); ``tensors``
    maps a tensor's name to new data of its type; ``add_tensors`` are new tensors (float32 arrays) after the
    others. Every other key keeps its place and type, every other tensor its bytes, the file its magic (PWRI or
    GGUF)."""
    import tempfile

    from gguf import GGUFReader, GGUFValueType, GGUFWriter, Keys

    data = path.read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "copy.gguf"
        copy.write_bytes(b"GGUF" + data[4:])  # gguf-py reads only the GGUF magic
        reader = GGUFReader(copy)
        fields = {name: (f.contents(), GGUFValueType(f.types[0]),
                         GGUFValueType(f.types[-1]) if f.types[0] == GGUFValueType.ARRAY else None)
                  for name, f in reader.fields.items() if not name.startswith("GGUF.")}
        for key, change in changes.items():
            if change is None:
                fields.pop(key, None)
            else:
                fields[key] = (*change, None) if len(change) == 2 else change
        writer = GGUFWriter(path, fields.pop(Keys.General.ARCHITECTURE)[0])
        for key, (value, kind, item_kind) in fields.items():
            if key == Keys.General.ALIGNMENT:
                writer.data_alignment = value  # where the tensors start, as the key says
            writer.add_key_value(key, value, kind, item_kind)
        for t in reader.tensors:
            writer.add_tensor(t.name, (tensors or {}).get(t.name, t.data), raw_dtype=t.tensor_type)
        for name, values in (add_tensors or {}).items():
            writer.add_tensor(name, values)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    with open(path, "r+b") as f:
        f.write(data[:4])
