"""Inputs for the error-contract tests, written with NumPy and gguf-py alone (no torch): a tiny ReLU LLaMA
checkpoint with the bundled model's tokenizer, edits to a checkpoint's config.json, and a GGUF file
holding only metadata."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from gguf import GGUFWriter
from powerinfer_tools.formats.gguf_names import tensor_names
from safetensors.numpy import save_file

from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.models import spec_from_config

TINY = dict(model_type="llama", hidden_act="relu", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, vocab_size=4096, max_position_embeddings=64,
            rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)

HYPERPARAMETERS = {
    "llama.context_length": 64, "llama.embedding_length": 32, "llama.block_count": 2,
    "llama.feed_forward_length": 64, "llama.attention.head_count": 2, "llama.attention.head_count_kv": 2,
    "llama.vocab_size": 100, "llama.attention.layer_norm_rms_epsilon": 1e-5,
}


def tiny_checkpoint(folder: Path) -> Path:
    """A random 2-layer ReLU LLaMA (no torch needed) with the bundled model's tokenizer and some of its text."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = tensor_names(spec_from_config(TINY), powerinfer=False)
    save_file({t.sources[0]: (0.2 * rng.standard_normal(t.shape)).astype(np.float32) for t in names},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(TINY))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(BUNDLED_MODEL / name, folder / name)
    (folder / "heldout.txt").write_text((BUNDLED_MODEL / "heldout.txt").read_text(encoding="utf-8")[:20000])
    return folder


def edit_config(model: Path, **changes) -> None:
    """Set keys of ``model``'s config.json; a key given None is removed."""
    path = model / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def write_gguf(path: Path, **changes) -> Path:
    """A GGUF file holding only metadata: the hyperparameters with ``changes`` (typed by their Python type)."""
    writer = GGUFWriter(path, "llama")
    for key, value in dict(HYPERPARAMETERS, **{k.replace("__", "."): v for k, v in changes.items()}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path
