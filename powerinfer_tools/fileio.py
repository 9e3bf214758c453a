"""Writing outputs atomically: a crash, a full disk or Ctrl-C never leaves a half-written file."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Iterator

from .errors import PitoolsError


def check_writable_output(path: Path, force: bool) -> None:
    """Refuse to overwrite an existing output unless asked to."""
    if path.exists() and not force:
        raise PitoolsError(f"{path}: output exists; pass --force to overwrite it")


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` on success.

    The temporary file lives in the same directory so the final rename is atomic
    and never crosses file systems. On any exception it is removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix + ".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise PitoolsError(f"{path}: could not write output: {exc.strerror or exc}") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_json(path: Path):
    """The JSON content of ``path``; a file that is not valid JSON is a one-line error naming it."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PitoolsError(f"{path}: invalid JSON ({exc})") from None


def write_json(path: Path, content: dict) -> None:
    """Write ``content`` as indented JSON, atomically."""
    with atomic_output(path) as tmp:
        tmp.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
