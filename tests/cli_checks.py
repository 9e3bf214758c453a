"""Running ``pitools`` in-process, and the checks of the error contract (docs/reliability.md):
one ``pitools: error:`` line, exit status 1, inputs left as they were."""

from __future__ import annotations

import hashlib
from pathlib import Path

from click.testing import CliRunner, Result

from powerinfer_tools.commands.cli import cli


def invoke(*args) -> Result:
    """Run ``pitools ARGS`` (paths and numbers as their text)."""
    return CliRunner().invoke(cli, [str(a) for a in args])


def fails(*args, match: str, names: Path | str | None = None) -> str:
    """Run ``pitools ARGS``; check it exited with status 1 and exactly one error line that says ``match``
    (and names ``names``, when given). Returns that line."""
    result = invoke(*args)
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1, (
        result.stdout, result.stderr, result.exception)
    assert result.stderr.startswith("pitools: error: ") and result.stderr.count("\n") == 1, result.stderr
    line = result.stderr.rstrip("\n")
    assert match in line and (names is None or str(names) in line), line
    return line


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` and the hash of its bytes (folders as such, so that one made is seen)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
            for p in sorted(folder.rglob("*"))}
