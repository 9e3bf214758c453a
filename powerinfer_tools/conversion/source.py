"""What ``pitools convert`` reads: a Hugging Face checkpoint (a folder, or a hub id downloaded into one),
or a GGUF file read as one (``gguf_source.GGUFSource``). Both answer the same questions: config,
tensors by Hugging Face name, tokenizer, and the tokenizer's metadata for the output."""

from __future__ import annotations

from pathlib import Path

from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.checkpoints.hub import resolve_checkpoint
from powerinfer_tools.conversion.gguf_source import GGUFSource
from powerinfer_tools.formats.constants import POWERINFER_MAGIC_BYTES
from powerinfer_tools.formats.model_file import GGUF_MAGIC_BYTES

GGUF_SUFFIX = ".gguf"


def is_gguf_file(source: str | Path) -> bool:
    """Whether ``source`` names a GGUF file: by its suffix, or by the magic of a file without one (Ollama
    keeps its models as blobs named by their digest)."""
    path = Path(source).expanduser()
    if path.suffix == GGUF_SUFFIX:
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) in (GGUF_MAGIC_BYTES, POWERINFER_MAGIC_BYTES)
    except OSError:  # a folder, a hub id, nothing there: not a file to read
        return False


def source_path(source: str, progress: bool = True) -> Path:
    """The local path of ``source``: a GGUF file as given, a checkpoint folder (a hub id downloaded into
    the Hugging Face cache)."""
    return Path(source).expanduser() if is_gguf_file(source) else resolve_checkpoint(source, progress=progress)


def open_source(path: Path) -> Checkpoint | GGUFSource:
    """The checkpoint folder or GGUF file at ``path`` (from ``source_path``), checked and ready to read."""
    return GGUFSource(path) if is_gguf_file(path) else Checkpoint(path)
