"""Hugging Face checkpoints on disk: config.json plus safetensors shards, memory-mapped
(``formats.safetensors_file``), and the tokenizer beside them."""

from __future__ import annotations

from pathlib import Path

from powerinfer_tools.checkpoints.tokenizer import CheckpointTokenizer
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.fileio import read_json
from powerinfer_tools.formats.model_spec import ModelSpec
from powerinfer_tools.formats.safetensors_file import FLOAT_DTYPES, SafetensorsTensors
from powerinfer_tools.formats.tokenizer_gguf import GGUFVocab, read_vocab


class Checkpoint(SafetensorsTensors):
    """A checkpoint folder: ``config.json`` and one or more ``*.safetensors`` files."""

    # Its spec is config.json's (``models.checkpoint_spec``); a source without one (a GGUF file read as a
    # checkpoint, ``conversion/gguf_source.py``) has its own here.
    spec: ModelSpec | None = None

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise PitoolsError(f"{self.folder}: not a checkpoint folder")
        self.config_path = self.folder / "config.json"
        self.config = self._read_config()
        super().__init__(self._shard_paths(), where=self.folder)

    def _read_config(self) -> dict:
        """config.json as parsed; ``models.spec_from_config(config, config_path)`` checks its content."""
        if not self.config_path.is_file():
            raise PitoolsError(f"{self.folder}: no config.json; is this a Hugging Face checkpoint folder?")
        return read_json(self.config_path)

    def _shard_paths(self) -> list[Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            content = read_json(index)
            weight_map = content.get("weight_map") if isinstance(content, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise PitoolsError(f"{index}: invalid safetensors index (weight_map must map tensor names to files)")
            paths = [self.folder / name for name in sorted(set(weight_map.values()))]
            missing = [p.name for p in paths if not p.is_file()]
            if missing:
                raise PitoolsError(f"{index}: names shard(s) that are missing: {', '.join(missing)}")
            return paths
        paths = sorted(self.folder.glob("*.safetensors"))
        if not paths:
            bins = sorted(self.folder.glob("*.bin"))
            hint = " (only PyTorch .bin weights; re-save them with safetensors)" if bins else ""
            raise PitoolsError(f"{self.folder}: no *.safetensors weights found{hint}")
        return paths

    def check_weight(self, name: str, shape: tuple[int, ...]) -> None:
        """Refuse a tensor that is not a floating-point weight of the shape config.json implies."""
        info = self.info(name)
        if info.dtype not in FLOAT_DTYPES:
            raise PitoolsError(f"{info.path}: tensor {name!r} is stored as {info.dtype}; weights must be "
                               f"floating point ({', '.join(FLOAT_DTYPES)})")
        if info.shape != tuple(shape):
            raise PitoolsError(
                f"{info.path}: tensor {name!r} has shape {list(info.shape)}, config.json implies {list(shape)}"
            )

    def tokenizer(self, spec: ModelSpec) -> CheckpointTokenizer:
        """The checkpoint's tokenizer, with ``spec``'s special tokens."""
        return CheckpointTokenizer(self.folder, spec.bos_token_id, spec.eos_token_id)

    def vocab(self, n_vocab: int) -> GGUFVocab:
        """The tokenizer as GGUF metadata, padded to ``n_vocab`` tokens."""
        return read_vocab(self.folder, n_vocab)
