"""Running ``pitools`` in-process, and the checks of the error contract (docs/reference/errors.md):
one ``pitools: error:`` line, exit status 1, inputs left as they were. ``fails`` checks one refusal;
``check`` any run of a ``Command``, as the fuzz tests (tests/test_fuzz.py, tests/test_typed_metadata.py) do."""

from __future__ import annotations

import hashlib
import shutil
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from click.testing import CliRunner, Result
from powerinfer_tools.formats.gpu_split import read_gpu_split

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


# --- a run checked against the contract, whether it succeeds or not --------------------------------------


@dataclass(frozen=True)
class Command:
    """A command line whose run ``check`` holds to the contract."""

    args: list
    output: Path | None = None  # the file it writes when it succeeds
    validate: Callable[[Path], object] | None = None  # opens that file; raises if it is not valid
    names: tuple[str, ...] = ()  # its error line must name one: a file, a folder, an option (as "vram")

    def __str__(self) -> str:
        return " ".join(Path(a).name if isinstance(a, Path) else repr(a)[:60] for a in self.args)


def uncaught(result: Result) -> str | None:
    """The traceback a user would see: any exception CliRunner caught that is not an exit."""
    if result.exception is None or isinstance(result.exception, SystemExit):
        return None
    return "".join(traceback.format_exception(*result.exc_info))


def refusal_problems(result: Result, command: Command) -> list[str]:
    """How a failed run breaks the contract: not exactly one ``pitools: error:`` line, the last, after nothing
    but ``pitools:`` notices (a first run's "compiling the kernels" precedes a refusal that needs the model
    loaded), or one naming none of ``command.names``."""
    lines = result.stderr.splitlines()
    notices = lines[:-1]
    if (not lines or not lines[-1].startswith("pitools: error: ")
            or not all(line.startswith("pitools: ") and not line.startswith("pitools: error") for line in notices)):
        return [f"exit {result.exit_code} without exactly one 'pitools: error:' line; stderr: {result.stderr[-600:]!r}"]
    lines = lines[-1:]
    if command.names and not any(name.lower() in lines[0].lower() for name in command.names):
        return [f"the error line names none of {list(command.names)}: {lines[0][:300]!r}"]
    return []


def _success_problems(result: Result, command: Command) -> list[str]:
    if "nan" in result.stderr.lower().split():
        return [f"succeeded but reports nan: {result.stderr[-300:]!r}"]
    if command.output is None:
        return []
    try:
        command.validate(command.output)
    except Exception as exc:  # noqa: BLE001 - any failure to open it means the output is not valid
        return [f"exit 0 but the output does not open: {type(exc).__name__}: {exc}"]
    return []


def contract_problems(result: Result, command: Command, out: Path) -> list[str]:
    """How ``result`` breaks the error contract, if it does (an empty list when it keeps it)."""
    traceback_text = uncaught(result)
    if traceback_text is not None:
        frames = [line for line in traceback_text.splitlines() if line.strip(" ^~")]  # without the column markers
        problems = ["uncaught exception (a traceback for the user), ending:\n" + "\n".join(frames[-12:])]
    elif result.exit_code == 0:
        problems = _success_problems(result, command)
    else:
        problems = refusal_problems(result, command)
    if traceback_text is None and "Traceback" in result.stdout + result.stderr:
        problems.append("'Traceback' in the output")
    expected = [command.output.name] if result.exit_code == 0 and command.output else []
    left = sorted(p.name for p in out.iterdir())
    if left != expected:
        problems.append(f"the output folder holds {left}, expected {expected}")
    return problems


def check(command: Command, inputs: Path, out: Path) -> tuple[bool, list[str]]:
    """Run ``command`` with ``out`` emptied first; whether it succeeded, and how it broke the contract."""
    clear(out)
    before = snapshot(inputs)
    result = CliRunner().invoke(cli, [str(a) for a in command.args])
    problems = contract_problems(result, command, out)
    if snapshot(inputs) != before:
        problems.append(f"an input changed: {changed_files(before, snapshot(inputs))}")
    return result.exit_code == 0 and not problems, [f"{command}: {p}" for p in problems]


def changed_files(before: dict, after: dict) -> list[str]:
    """The files that differ between two ``snapshot``s of a folder."""
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def clear(folder: Path) -> None:
    """Remove everything in ``folder``."""
    for p in folder.iterdir():
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def folders(tmp: Path, *names: str) -> list[Path]:
    """New empty folders ``names`` in ``tmp``."""
    for name in names:
        (tmp / name).mkdir()
    return [tmp / name for name in names]


# --- the commands both fuzz tests run -----------------------------------------------------------------------


def run_command(model: Path, *extra, names: tuple[str, ...] = ()) -> Command:
    """``run`` generating 2 tokens; its error may also name the prompt, one of its inputs."""
    # One kernel thread: on a busy 2-core machine, the parallel kernels' start-up dominates a tiny model.
    args = ["run", model, "-n", "2", "-p", "def ", "-t", "1", "--no-split", *extra]
    return Command(args, names=(model.name, "prompt", *names))


def solve_command(model: Path, out: Path, *options: str, names: tuple[str, ...] = ()) -> Command:
    """``solve`` within 2 seconds, its split written into ``out``, which must then open."""
    split = out / "fuzzed.gpuidx"
    args = ["solve", model, *options, "--time-limit", "2", "-o", split]
    return Command(args, split, read_gpu_split, (model.name, split.name, *names))
