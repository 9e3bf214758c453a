"""Writing outputs atomically: a crash, a full disk or Ctrl-C never leaves a half-written file."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import Iterable, Iterator

from powerinfer_tools.errors import PitoolsError


def check_writable_output(path: Path, force: bool, inputs: Iterable[str | os.PathLike] = ()) -> None:
    """Refuse an output path that is one of the command's inputs (even with --force), or that
    exists, unless asked to overwrite it. Called before any work, so nothing is spent in vain."""
    path = Path(path)
    for source in inputs:
        if _same_file(path, Path(source)):
            raise PitoolsError(f"{path}: output path is the input {source}; choose another output path")
    if path.exists() and not force:
        raise PitoolsError(f"{path}: output exists; pass --force to overwrite it")


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name the same file (the same path, a symlink to it, or a hard link)."""
    try:
        return a.samefile(b)
    except OSError:  # one of them does not exist: writing ``a`` cannot destroy ``b``
        return False


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` on success.

    The temporary file lives in the same directory so the final rename is atomic
    and never crosses file systems. On any exception (Ctrl-C and SIGTERM included:
    the command line turns SIGTERM into an interruption) it is removed. The result
    gets the permissions of a file created under the user's umask (it is 0600
    while it is written).
    """
    path = Path(path)
    # The name is chosen before the file exists, so that the cleanup below knows it whenever Ctrl-C or
    # SIGTERM lands, even between creating the file and returning from the call that created it
    # (a name from mkstemp is not known there). 64 random bits: no other file has it.
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}{suffix}.tmp"
    try:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError as exc:
            raise PitoolsError(f"{path}: cannot write output: {exc.strerror or exc}") from None
        yield tmp
        os.chmod(tmp, 0o666 & ~_current_umask())
        os.replace(tmp, path)
    except OSError as exc:
        _remove(tmp)
        raise PitoolsError(f"{path}: could not write output: {exc.strerror or exc}") from exc
    except BaseException:
        _remove(tmp)
        raise


def _remove(tmp: Path) -> None:
    """Remove a temporary file if it is there; never raise over the error being reported."""
    with contextlib.suppress(OSError):
        tmp.unlink()


def read_json(path: Path):
    """The JSON content of ``path``; a file that is not valid JSON is a one-line error naming it."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PitoolsError(f"{path}: invalid JSON ({exc})") from None
    except RecursionError:
        raise PitoolsError(f"{path}: invalid JSON (nested too deeply)") from None
    except OSError as exc:
        raise PitoolsError(f"{path}: cannot read: {exc.strerror or exc}") from None


def write_json(path: Path, content: dict) -> None:
    """Write ``content`` as indented JSON, atomically."""
    with atomic_output(path) as tmp:
        tmp.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
