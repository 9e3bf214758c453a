"""Model families: one module each, holding its row (``ARCHITECTURE``, ``formats/architecture.py``: how its
config.json reads, its tensors, what llama.cpp calls it) and, where no other family's serves, its reference
NumPy model. ``FAMILIES`` lists them; this module finds a checkpoint's or a GGUF file's family by its row."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import Keys

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.checkpoints.tokenizer import CheckpointTokenizer
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats import gguf_spec
from powerinfer_tools.formats.architecture import Architecture
from powerinfer_tools.formats.model_file import ModelFile
from powerinfer_tools.formats.model_spec import FFNKind, ModelSpec, NormKind, spec_errors_named
from powerinfer_tools.models import gemma2, gemma3, llama, mistral, mixtral, opt, phi3, qwen2, qwen3
from powerinfer_tools.models.base import DecoderModel

FAMILIES: tuple[Architecture, ...] = tuple(module.ARCHITECTURE for module in (llama, mistral, mixtral, qwen2, qwen3,
                                                                                phi3, gemma2, gemma3, opt))


def _family_of_config(config: dict) -> Architecture:
    model_type = config.get("model_type")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    supported = ", ".join(sorted(t for family in FAMILIES for t in family.model_types))
    raise PitoolsError(f"model_type {model_type!r:.40} is not supported (supported: {supported})")


def spec_from_config(config: dict, source: str | os.PathLike = "config.json") -> ModelSpec:
    """The typed spec of a Hugging Face ``config.json`` (already parsed); errors name ``source``, its path."""
    with spec_errors_named(source, {}):
        if not isinstance(config, dict):
            raise PitoolsError(f"not a JSON object but {type(config).__name__} {config!r:.40}")
        family = _family_of_config(config)
    with spec_errors_named(source, family.config_keys):
        return family.spec_from_config(config)


def gguf_family(model: ModelFile) -> Architecture | None:
    """The family of a GGUF model file (by its architecture and whether it has experts), None if none is."""
    moe = bool(model.get(Keys.LLM.EXPERT_COUNT, 0))
    return next((family for family in FAMILIES if family.reads_gguf(model.architecture, moe)), None)


def spec_from_model_file(model: ModelFile) -> ModelSpec:
    """The spec of a GGUF model file, read as its family's (``formats/gguf_spec.py``); a file of no supported
    family is refused, naming it."""
    family = gguf_family(model)
    if family is not None:
        return gguf_spec.spec_from_model_file(model, family)
    names = sorted({name for family in FAMILIES for name in (family.gguf_names
                                                                if family.gguf_names is not None
                                                                else (family.gguf_name,))})
    raise PitoolsError(f"{model.path}: architecture {model.architecture!r:.40} is not supported (supported: "
                       f"{', '.join(names)})")


def checkpoint_spec(checkpoint) -> ModelSpec:
    """The spec of a checkpoint (its config.json's), or of a GGUF file read as one (its own)."""
    if checkpoint.spec is not None:
        return checkpoint.spec
    return spec_from_config(checkpoint.config, checkpoint.config_path)


def load_model(checkpoint: Checkpoint, dtype=np.float32, layers: range | None = None) -> DecoderModel:
    """The reference NumPy model of a checkpoint folder, weights converted to ``dtype``; with ``layers``, only
    those layers' blocks are read (``DecoderModel.from_checkpoint``)."""
    spec = checkpoint_spec(checkpoint)
    return spec.architecture.model.from_checkpoint(spec, checkpoint, dtype, layers)


def load_model_and_tokenizer(folder: Path, layers: range | None = None) -> tuple[DecoderModel, CheckpointTokenizer]:
    """A checkpoint folder's reference model (of ``layers`` only, if given) and its tokenizer (with the
    model's special tokens)."""
    checkpoint = Checkpoint(folder)
    model = load_model(checkpoint, layers=layers)
    return model, checkpoint.tokenizer(model.spec)


__all__ = ["FAMILIES", "DecoderModel", "FFNKind", "ModelSpec", "NormKind", "checkpoint_spec", "gguf_family", "load_model",
           "load_model_and_tokenizer", "spec_from_config", "spec_from_model_file"]
