"""Writing outputs atomically: a crash, a full disk or Ctrl-C never leaves a half-written file."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import stat
import time
from pathlib import Path
from typing import Iterable, Iterator

from powerinfer_tools.errors import PitoolsError


def check_writable_output(path: Path, force: bool, inputs: Iterable[str | os.PathLike] = ()) -> None:
    """Refuse an output path that is one of the command's inputs (even with --force), that is not a
    regular file (a device, a FIFO, a folder: even with --force, so ``-o /dev/null --force`` never
    replaces the system's /dev/null), whose folder does not exist, or that exists, unless asked to
    overwrite it. Called before any work, so nothing is spent in vain."""
    path = Path(path)
    for source in inputs:
        if _same_file(path, Path(source)):
            raise PitoolsError(f"{path}: output path is the input {source}; choose another output path")
    _check_replaceable(path, follow_links=True)
    _check_parent(path)
    if path.exists() and not force:
        raise PitoolsError(f"{path}: output exists; pass --force to overwrite it")


def check_output_folder(path: Path) -> None:
    """Refuse an output folder (a profile's, predictors') that is something else, or whose parent does
    not exist: only the folder named is created, never a chain of them from a mistyped path."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise PitoolsError(f"{path}: output folder exists and is {_kind(os.stat(path).st_mode)}, not a folder")
    _check_parent(path)


def _check_parent(path: Path) -> None:
    """The folder an output goes in must be there: a mistyped path is refused, not created."""
    if not path.parent.is_dir():
        why = "is not a folder" if path.parent.exists() else "does not exist"
        raise PitoolsError(f"{path}: {path.parent} {why}; outputs go into an existing folder")


def _check_replaceable(path: Path, follow_links: bool) -> None:
    """An output may replace nothing but a regular file (or, when not following links, a symbolic link
    itself: replacing the link leaves what it points to untouched)."""
    try:
        mode = os.stat(path).st_mode if follow_links else os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # nothing there to replace; the folder is checked apart
        return
    except OSError as exc:
        raise PitoolsError(f"{path}: cannot check the output path: {exc.strerror or exc}") from None
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise PitoolsError(f"{path}: output path is {_kind(mode)}, not a regular file; choose another output path")


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file"))
    return next((name for test, name in kinds if test(mode)), "a special file")


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
def atomic_output(path: str | os.PathLike, *, overwrite: bool, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; move it onto ``path`` on success.

    The temporary file lives in the same directory so the final move is atomic and never crosses
    file systems. Without ``overwrite`` the move is exclusive (a hard link, which fails if ``path``
    exists): of two runs writing the same new output, the second fails rather than replacing the
    first's. With it, only a regular file (or a link) is replaced. On any exception (Ctrl-C and
    SIGTERM included: the command line turns SIGTERM into an interruption) the temporary file is
    removed. While it is written it is locked (``flock``), so that a temporary file left by a killed
    run, whose lock died with it, is recognised and removed by the next run writing ``path``. The
    result gets the permissions of a file created under the user's umask (it is 0600 while written).
    """
    path = Path(path)
    # The name is chosen before the file exists, so that the cleanup below knows it whenever Ctrl-C or
    # SIGTERM lands, even between creating the file and returning from the call that created it
    # (a name from mkstemp is not known there). 64 random bits: no other file has it.
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}{suffix}.tmp"
    lock = None
    try:
        try:
            remove_stale_temporaries(path)
            lock = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as exc:
            raise PitoolsError(f"{path}: cannot write output: {exc.strerror or exc}") from None
        yield tmp
        os.chmod(tmp, 0o666 & ~_current_umask())
        _move_into_place(tmp, path, overwrite)
    except OSError as exc:
        _remove(tmp)
        raise PitoolsError(f"{path}: could not write output: {exc.strerror or exc}") from exc
    except BaseException:
        _remove(tmp)
        raise
    finally:
        if lock is not None:
            os.close(lock)


def _move_into_place(tmp: Path, path: Path, overwrite: bool) -> None:
    """``tmp`` onto ``path``: replacing a regular file only with ``overwrite``, never anything else."""
    if overwrite:
        _check_replaceable(path, follow_links=False)  # again: the path may have changed during the work
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise PitoolsError(f"{path}: output exists (written by another run meanwhile?); "
                           "pass --force to overwrite it") from None
    os.unlink(tmp)


def _temporaries_of(path: Path) -> Iterator[Path]:
    """The temporary files ``atomic_output`` names for ``path``: ``.NAME.<16 hex digits>[suffix].tmp``."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.[0-9a-f]{{16}}[^/]*\.tmp")
    with contextlib.suppress(OSError):
        for entry in os.scandir(path.parent):
            if pattern.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                yield Path(entry.path)


def remove_stale_temporaries(path: Path) -> list[Path]:
    """Remove the temporary files of ``path`` that no running writer holds (their writer was killed
    with SIGKILL, or the machine went down); return them. A live writer's file is locked: left alone."""
    removed = []
    for tmp in _temporaries_of(Path(path)):
        try:
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # locked: being written now
            continue
        else:
            # Created but not yet locked by a writer that is starting this instant: a newborn file.
            if time.time() - os.fstat(fd).st_mtime >= _NEWBORN_SECONDS:
                _remove(tmp)
                removed.append(tmp)
        finally:
            os.close(fd)
    return removed


_NEWBORN_SECONDS = 5.0


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
    """Write ``content`` as indented JSON, atomically, replacing an earlier version."""
    with atomic_output(path, overwrite=True) as tmp:
        tmp.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
