"""The user's documentation cannot rot: its commands run, its CLI reference is the commands' own help, and it
holds only what stays true (no dates, issue numbers or paths of a machine), within a size a reader can take.

The user path is README.md and docs/**/*.md, except docs/lab/ (the lab notebook: dated studies, the evidence)
and docs/architecture.md (the developers' map of the code).

How its shell blocks run (the convention a page's author writes for):

- every ```bash and ```python block runs, unless the line before its opening fence is
  ``<!-- not run: REASON -->`` (a GPU, the network, a long conversion, a server left running...);
- a page's blocks run in order, each in its own ``bash -euo pipefail`` (or ``python``), all in one fresh temporary folder per
  page, which holds ``examples/``, a link to the checkout's (so the docs' ``examples/tiny-relu-llama`` is found
  as it is from the checkout's root, where the user runs them);
- that folder also holds ``tiny.powerinfer.gguf.work/``, a link to the profile and predictors that the README's
  conversion of the bundled model writes, made once per test session by that very command. Every page's
  ``pitools convert examples/tiny-relu-llama -o tiny.powerinfer.gguf --tokens 20000`` then reuses them, as a
  user's second conversion does, instead of training the predictors again on every page (a link, not a copy:
  the predictors record their profile's real path);
- ``pip install`` lines are left out: the tests run in the environment already installed (``.ci/run`` runs the
  README's first line, ``pip install -e .``, in a new virtual environment);
- ``pitools`` is this checkout's: the Python running the tests puts its own ``bin`` folder first on PATH and the
  checkout first on PYTHONPATH;
- whatever a block leaves running (a server started with ``&``) is stopped when the block ends;
- the docs' port, ``8080``, is a free one of the machine's in each page's run (another program may hold 8080).
"""

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from powerinfer_tools.commands import reference

ROOT = Path(__file__).resolve().parents[1]
MAX_USER_PATH_BYTES = 150_000
BLOCK_TIMEOUT_S = 900  # a block with a conversion on a busy 2-core machine
DOCS_PORT = "8080"  # the port the docs' serve examples use
NOT_RUN = re.compile(r"<!-- not run: \S.* -->")
FENCE = re.compile(r"^```(\w*)\s*$")
BUNDLED_CONVERSION = "pitools convert examples/tiny-relu-llama -o tiny.powerinfer.gguf --tokens 20000"
WORK_FOLDER = "tiny.powerinfer.gguf.work"


def user_pages() -> list[Path]:
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md")
                  if "lab" not in p.relative_to(ROOT / "docs").parts[:1] and p.name != "architecture.md")
    return [ROOT / "README.md", *docs]


def blocks(page: Path) -> list[tuple[str, str | None, str]]:
    """A page's fenced blocks: (language, the not-run reason or None, text)."""
    found, lines = [], page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = NOT_RUN.search(lines[i - 1]) if i > 0 else None
        reason = marker.group(0) if marker else None
        found.append((opening.group(1), reason, "\n".join(lines[i + 1:end])))
        i = end + 1
    return found


def runnable(page: Path) -> list[list[str]]:
    """The commands that run the page's blocks, in order: ```bash ones with their ``pip install`` lines left out."""
    commands = []
    for language, reason, text in blocks(page):
        if reason is None and language == "bash":
            lines = [line for line in text.splitlines() if not line.startswith("pip install")]
            commands.append(["bash", "-euo", "pipefail", "-c", "\n".join(lines)])
        elif reason is None and language == "python":
            commands.append([sys.executable, "-c", text])
    return commands


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_the_user_path_is_short_enough_to_read():
    size = sum(page.stat().st_size for page in user_pages())
    assert size <= MAX_USER_PATH_BYTES, f"the user path is {size} bytes: move studies and figures to docs/lab/"


STALE = {
    "a date": re.compile(r"\b(19|20)\d\d-\d\d\b"),
    "an issue number": re.compile(r"\bissues? \d+|(?<![\w&/])#\d+\b", re.IGNORECASE),
    "a path of a machine": re.compile(r"/work/|/root/|/tmp/pytest|/home/"),
}


@pytest.mark.parametrize("page", user_pages(), ids=name)
def test_a_user_page_holds_nothing_that_goes_stale(page):
    text = page.read_text(encoding="utf-8")
    found = [f"{what}: {match.group(0)!r}" for what, pattern in STALE.items() for match in pattern.finditer(text)]
    assert not found, f"{name(page)}: {found} (dated studies and history belong in docs/lab/)"


@pytest.mark.parametrize("page", user_pages(), ids=name)
def test_a_user_pages_links_lead_somewhere(page):
    text = page.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    broken = [t for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")
              and not (page.parent / t.split("#")[0]).exists()]
    assert not broken, f"{name(page)}: links to nothing: {broken}"


@pytest.mark.parametrize("page", user_pages(), ids=name)
def test_every_block_not_run_says_why_and_every_shell_block_is_bash(page):
    for language, reason, text in blocks(page):
        assert language in ("bash", "python", "text", "json", "console", ""), f"{name(page)}: ```{language}"
        assert language != "console", f"{name(page)}: write shell blocks as ```bash (run), not ```console"
    markers = page.read_text(encoding="utf-8").count("<!-- not run")
    assert markers == sum(reason is not None for _, reason, _ in blocks(page)), (
        f"{name(page)}: a <!-- not run: REASON --> marker must be the line just before a block's fence")


def test_the_cli_reference_is_the_commands_help():
    page = (ROOT / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    assert page == reference.page(), (
        "docs/reference/cli.md is not the commands' current --help: "
        "python -m powerinfer_tools.commands.reference > docs/reference/cli.md")


def test_the_readmes_first_command_is_the_install_that_ci_runs():
    first = next(text for language, _, text in blocks(ROOT / "README.md") if language == "bash")
    assert first.splitlines()[0] == "pip install -e ."  # .ci/run runs exactly this line in a new environment


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def free_port() -> int:
    """A TCP port no program listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_block(command: list[str], folder: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``command`` in ``folder``; whatever it started is stopped when it ends."""
    process = subprocess.Popen(command, cwd=folder, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        output += f"\n(stopped after {BLOCK_TIMEOUT_S} s)"
    finally:
        try:
            os.killpg(process.pid, signal.SIGTERM)  # a server the block left in the background
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(command, process.returncode, output)


def page_folder(tmp_path_factory, page: Path) -> Path:
    folder = tmp_path_factory.mktemp(page.stem)
    (folder / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    return folder


@pytest.fixture(scope="session")
def bundled_work(tmp_path_factory) -> Path:
    """The README's conversion of the bundled model, run once: its work folder (profile, predictors)."""
    folder = page_folder(tmp_path_factory, ROOT / "README.md")
    done = run_block(["bash", "-euo", "pipefail", "-c", BUNDLED_CONVERSION + " --quiet"], folder, environment())
    assert done.returncode == 0, done.stdout[-3000:]
    return folder / WORK_FOLDER


def test_the_shared_conversion_is_the_readmes():
    assert any(BUNDLED_CONVERSION in command[-1] for command in runnable(ROOT / "README.md"))


PAGES_THAT_RUN = [page for page in user_pages() if runnable(page)]


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES_THAT_RUN, ids=name)
def test_a_pages_shell_blocks_run(page, bundled_work, tmp_path_factory):
    folder = page_folder(tmp_path_factory, page)
    (folder / WORK_FOLDER).symlink_to(bundled_work, target_is_directory=True)
    env, port = environment(), str(free_port())
    for number, command in enumerate(runnable(page), 1):
        command = [part.replace(DOCS_PORT, port) for part in command]
        done = run_block(command, folder, env)
        assert done.returncode == 0, (f"{name(page)}, block {number} failed ({done.returncode}):\n{command[-1]}\n"
                                      f"--- its output:\n{done.stdout[-4000:]}")
