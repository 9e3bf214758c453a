"""Model architectures: one module per family, each turning a config.json into a
``ModelSpec`` and checkpoint weights into a NumPy ``Model``."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import numpy as np

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.checkpoints.tokenizer import CheckpointTokenizer
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.model_spec import FFNKind, ModelSpec, NormKind, spec_errors_named
from powerinfer_tools.models import gemma3, llama, mistral, mixtral, opt, qwen2
from powerinfer_tools.models.base import DecoderModel

# config.json "model_type" -> the module that reads it.
ARCHITECTURES: dict[str, ModuleType] = {
    "llama": llama,
    "mistral": mistral,
    "bamboo": mistral,
    "mixtral": mixtral,
    mixtral.TURBOSPARSE: mixtral,
    qwen2.ARCHITECTURE: qwen2,
    gemma3.MODEL_TYPE: gemma3,
    "opt": opt,
}


def _module_for(config: dict) -> ModuleType:
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise PitoolsError(f"model_type {model_type!r} is not supported (supported: {supported})")
    return ARCHITECTURES[model_type]


def spec_from_config(config: dict, source: str | os.PathLike = "config.json") -> ModelSpec:
    """The typed spec of a Hugging Face ``config.json`` (already parsed); errors name ``source``, its path."""
    with spec_errors_named(source, {}):
        if not isinstance(config, dict):
            raise PitoolsError(f"not a JSON object but {type(config).__name__} {config!r:.40}")
        module = _module_for(config)
    with spec_errors_named(source, module.CONFIG_KEYS):
        return module.spec_from_config(config)


def config_from_spec(spec: ModelSpec) -> dict:
    """The config.json that reads back as ``spec`` (of a model that comes without one: a GGUF file)."""
    return (gemma3 if spec.architecture == gemma3.ARCHITECTURE else llama).config_from_spec(spec)


def load_model(checkpoint: Checkpoint, dtype=np.float32, layers: range | None = None) -> DecoderModel:
    """The reference NumPy model of a checkpoint folder, weights converted to ``dtype``; with ``layers``, only
    those layers' blocks are read (``DecoderModel.from_checkpoint``)."""
    spec = spec_from_config(checkpoint.config, checkpoint.config_path)
    return _module_for(checkpoint.config).Model.from_checkpoint(spec, checkpoint, dtype, layers)


def load_model_and_tokenizer(folder: Path, layers: range | None = None) -> tuple[DecoderModel, CheckpointTokenizer]:
    """A checkpoint folder's reference model (of ``layers`` only, if given) and its tokenizer (with the
    model's special tokens)."""
    checkpoint = Checkpoint(folder)
    model = load_model(checkpoint, layers=layers)
    return model, checkpoint.tokenizer(model.spec)


__all__ = ["ARCHITECTURES", "DecoderModel", "FFNKind", "ModelSpec", "NormKind", "config_from_spec", "load_model",
           "load_model_and_tokenizer", "spec_from_config"]
