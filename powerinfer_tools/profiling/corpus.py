"""Calibration and evaluation text as one stream of token ids.

Sources are plain text files (each file is one document, read whole),
JSON-lines files (``*.jsonl``: one document per line, an object with a text
field or a bare string) or a Hugging Face hub dataset (only when the optional
``datasets`` package is installed). Documents are tokenized one at a time with
the model's own tokenizer and concatenated; reading stops as soon as enough
tokens are in hand, so a large corpus costs only what is used.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from powerinfer_tools.checkpoints.hub import resolve_checkpoint
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.interfaces import Tokenizer
from powerinfer_tools.models import DecoderModel, load_model_and_tokenizer

JSONL_SUFFIXES = (".jsonl", ".ndjson")
# What the bundled model (and any checkpoint folder shipped the same way) keeps aside for evaluation.
HELDOUT_FILE = "heldout.txt"
DEFAULT_SEQ_LEN = 512  # tokens per forward pass, capped by the model's context length

@dataclass(frozen=True)
class CorpusSource:
    """Where the text comes from: files, or a hub dataset ``NAME`` or ``NAME:CONFIG``."""

    files: tuple[Path, ...] = ()
    dataset: str | None = None
    split: str = "train"
    text_field: str = "text"

    def describe(self) -> list[str]:
        """Names recorded in output metadata, so a resumed run can tell it reads the same corpus."""
        if self.dataset is not None:
            return [f"hf:{self.dataset}@{self.split}"]
        return [str(f) for f in self.files]


def resolve_source(files: tuple[Path, ...], dataset: str | None, model_folder: Path, split: str = "train",
                   text_field: str = "text") -> CorpusSource:
    """The corpus named on the command line, else the model folder's held-out text."""
    if files and dataset:
        raise PitoolsError("give either --corpus files or --dataset, not both")
    if files or dataset:
        return CorpusSource(tuple(files), dataset, split, text_field)
    heldout = model_folder / HELDOUT_FILE
    if not heldout.is_file():
        raise PitoolsError(f"{model_folder}: no {HELDOUT_FILE} to default to; pass --corpus FILE or --dataset NAME")
    return CorpusSource((heldout,), None, split, text_field)


def iter_documents(source: CorpusSource) -> Iterator[str]:
    if source.dataset is not None:
        yield from _dataset_documents(source)
        return
    for path in source.files:
        if not path.is_file():
            raise PitoolsError(f"{path}: no such corpus file")
        if path.suffix in JSONL_SUFFIXES:
            yield from _jsonl_documents(path, source.text_field)
        else:
            yield _read_text(path)


def read_tokens(source: CorpusSource, tokenizer: Tokenizer, max_tokens: int,
                skip_tokens: int = 0) -> np.ndarray:
    """Token ids ``skip_tokens .. skip_tokens + max_tokens`` of the corpus (fewer if it is shorter), as int32.

    Each document starts with BOS when the tokenizer adds one to prompts.
    ``skip_tokens`` lets evaluation read text that a profile of the same
    corpus's first tokens never saw.
    """
    if max_tokens < 1 or skip_tokens < 0:
        raise PitoolsError("the token count must be positive and the skip count non-negative")
    wanted = skip_tokens + max_tokens
    pieces, total = [], 0
    for text in iter_documents(source):
        ids = tokenizer.encode(text)
        pieces.append(np.asarray(ids, dtype=np.int32))
        total += len(ids)
        if total >= wanted:
            break
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    tokens = stream[skip_tokens:wanted]
    if len(tokens) < 2:
        raise PitoolsError(
            f"corpus {', '.join(source.describe())} has {len(stream)} tokens; "
            f"at least {skip_tokens + 2} are needed (after skipping {skip_tokens})"
        )
    return tokens


@dataclass
class ModelOnCorpus:
    """A loaded model and the corpus tokens it will read."""

    folder: Path
    model: DecoderModel
    source: CorpusSource
    tokens: np.ndarray
    seq_len: int


def load_model_and_corpus(model_arg: str, corpus: tuple[Path, ...], dataset: str | None, split: str,
                          text_field: str, n_tokens: int, seq_len: int | None, skip_tokens: int,
                          layers: range | None = None) -> ModelOnCorpus:
    """A checkpoint (folder or hub id) on the reference engine (of ``layers`` only, if given), and the
    corpus tokens it will read."""
    folder = resolve_checkpoint(model_arg)
    model, tokenizer = load_model_and_tokenizer(folder, layers)
    source = resolve_source(corpus, dataset, folder, split, text_field)
    tokens, seq_len = corpus_tokens(source, tokenizer, model.spec.max_positions, n_tokens, seq_len, skip_tokens)
    return ModelOnCorpus(folder, model, source, tokens, seq_len)


def corpus_tokens(source: CorpusSource, tokenizer, max_positions: int, n_tokens: int, seq_len: int | None,
                  skip_tokens: int) -> tuple[np.ndarray, int]:
    """The corpus tokens a model reads, and the window length (checked against its context)."""
    if seq_len is not None and seq_len > max_positions:
        raise PitoolsError(f"--seq-len {seq_len} exceeds the model's context length {max_positions}")
    tokens = read_tokens(source, tokenizer, n_tokens, skip_tokens)
    if len(tokens) < n_tokens:
        print(f"pitools: the corpus has only {len(tokens)} tokens (after skipping {skip_tokens}); using all of them",
              file=sys.stderr)
    return tokens, seq_len or min(DEFAULT_SEQ_LEN, max_positions)

def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PitoolsError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PitoolsError(f"{path}:{number}: invalid JSON ({exc.msg})") from None
            text = record if isinstance(record, str) else record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise PitoolsError(f"{path}:{number}: expected a string or an object with a string {field!r} field")
            yield text


def _dataset_documents(source: CorpusSource) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise PitoolsError(
            "--dataset needs the optional `datasets` package (pip install datasets); or pass --corpus FILE"
        ) from None
    name, _, config = source.dataset.partition(":")
    try:
        # Streaming reads only the records used instead of downloading the whole dataset.
        records = datasets.load_dataset(name, config or None, split=source.split, streaming=True)
        for record in records:
            text = record.get(source.text_field)
            if not isinstance(text, str):
                raise PitoolsError(f"dataset {source.dataset!r} has no string field {source.text_field!r}")
            yield text
    except PitoolsError:
        raise
    except Exception as exc:  # noqa: BLE001 - network, hub and format failures all become one line
        raise PitoolsError(f"cannot read dataset {source.dataset!r} split {source.split!r}: {exc}") from None
