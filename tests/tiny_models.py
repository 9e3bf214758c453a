"""Tiny random ReGLU LLaMA and OPT models for the profiling, predictor, perplexity and reorder tests,
a byte-level tokenizer that drives them, and a profiling run of one of them."""

from __future__ import annotations

import numpy as np
from hf_models import build
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from powerinfer_tools.profiling.profiler import Profiler, ProfileSettings

OPT = dict(hidden_size=48, ffn_dim=136, num_hidden_layers=2, num_attention_heads=4, vocab_size=90,
           max_position_embeddings=256, word_embed_proj_dim=48, pad_token_id=1)
# A random ReGLU LLaMA over a byte-level vocabulary (256 tokens) so a real tokenizer can drive it.
TINY_RELU_LLAMA = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=260, hidden_act="relu", max_position_embeddings=128)
WORDS = "def class return import self value none true false for while if else lambda yield".split()


def write_byte_tokenizer(folder) -> None:
    """A tokenizer.json with the 256 byte-level symbols and one merge (a byte-level BPE needs merges: llama.cpp
    refuses a file without): one token per byte, but " t"."""
    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["\u0120t"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("\u0120", "t")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))


def sample_text(n_words: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, size=n_words))


def build_tiny_model(folder, seed: int = 0, sparse: bool = False, hidden_act: str = "relu"):
    """Save a random tiny ReGLU LLaMA (or, with ``hidden_act="silu"``, SwiGLU) with a byte tokenizer and a
    heldout.txt; return the folder.

    A random ReGLU layer fires about half its neurons. ``sparse`` makes it fire
    a few percent, skewed, as a trained ReLU model does, and without biases
    (which a predictor could not imitate): every embedding gets a shared
    component ``c``, and each gate row is pushed against the direction ``c``
    takes after the FFN norm, by a per-neuron amount.
    """
    build(folder, "llama", seed=seed, config_overrides={**TINY_RELU_LLAMA, "hidden_act": hidden_act})
    if sparse:
        path = folder / "model.safetensors"
        tensors = load_file(path)
        rng = np.random.default_rng(seed)
        c = rng.standard_normal(TINY_RELU_LLAMA["hidden_size"]).astype(np.float32)
        tensors["model.embed_tokens.weight"] += 0.5 * c
        for i in range(TINY_RELU_LLAMA["num_hidden_layers"]):
            direction = c * tensors[f"model.layers.{i}.post_attention_layernorm.weight"]
            push = rng.normal(1.5, 0.5, (TINY_RELU_LLAMA["intermediate_size"], 1)).astype(np.float32)
            tensors[f"model.layers.{i}.mlp.gate_proj.weight"] -= push * direction / np.linalg.norm(direction)
        save_file(tensors, path, metadata={"format": "pt"})
    write_byte_tokenizer(folder)
    (folder / "heldout.txt").write_text(sample_text(2000, seed), encoding="utf-8")
    return folder


def run_profiler(model, tokens, folder, seq_len=128, **kwargs):
    settings = ProfileSettings(seq_len=seq_len, checkpoint_seconds=0, **kwargs)
    return Profiler(model, "tiny", tokens, ["test"], folder, settings).run(progress=False)
