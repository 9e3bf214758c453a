"""No timed figures or machine names in the package's prose: they go stale as the code and the machines change.

The prose read is every comment (``tokenize``), every string that stands alone as a statement (module, class
and function docstrings, and the attribute docstrings some modules write) and every ``help=``/``short_help=``
string passed to a call (click's options and commands). Measurements belong on the lab pages
(docs/lab/benchmarks.md, docs/lab/kernels.md, docs/lab/real-models.md), where they carry their date, machine
and command; the prose keeps the reason and, where the figure matters, points there.

A timed figure is a number followed by a unit of time (``0.4 ms``, ``40 us``, ``27 s``) or of rate (``tok/s``,
``GB/s``, ``reads/s``, ``tokens per second``), or a speed ratio written ``1.9x`` (but not ``2x2``, hex such as
``0x1F``, or a multiple of a count such as ``~8x the work``: those do not depend on the machine). Sizes
(``4 KiB``, ``2 MiB folio``) and counts are not timings, nor is a setting's value (``TIMEOUT = 30  # seconds``
is code; prose that states one is listed in ALLOWED with its reason). Machine names: ``EPYC``, ``Xeon``, ``Ryzen``,
"development machine" or "VM", "the 2-core machine" (ours; "on a 2-core machine" is a condition).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCE_FOLDERS = ("powerinfer_tools", "solver", "formats")
HELP_KEYWORDS = ("help", "short_help")

_NUMBER = r"(?<![\w.^])\d+(?:[.,]\d+)*"  # not 10^9's 9
TIMED_FIGURE = re.compile(
    "|".join((
        _NUMBER + r"\s*(?:ms|µs|us|ns)\b",                   # 0.4 ms, 40 us
        _NUMBER + r"\s+(?:s|secs?|seconds?|minutes?|hours?)\b",  # 27 s, 3 seconds ("0s and 1s" are digits, not times)
        r"(?<![\w.])\d+\.\d+(?:s|sec)\b",                     # 0.4s
        _NUMBER + r"\s*[kMG]?\s*[A-Za-z-]*/s\b",             # 812 tok/s, 12 GB/s, 50k reads/s, 30 G multiply-adds/s
        _NUMBER + r"\s*\w+\s+(?:per|a)\s+second\b",          # 100 tokens per second
        # A speed ratio: 1.9x, 0.85-0.99x, 20x slower; not 2x2, 0x1F, 0x{...}, nor "8x the work" (a count's
        # multiple), but "2x the speed" is one.
        r"(?<![\w.])(?!0x)\d+(?:\.\d+)?[x×](?![\w{])(?!\s+the\s+(?!speed|time|rate|throughput|bandwidth))",
        r"(?<![\w.])\d+(?:\.\d+)?%\s+(?:faster|slower)\b",                              # 10% faster
        r"(?i:\bEPYC\b|\bXeon\b|\bRyzen\b|\bdev(?:elopment)?\s+(?:machine|VM|box)\b)",
        # "the busy 2-core machine" is ours; "on a 2-core machine" is a condition
        r"(?i:\b(?:the|this|our)\s+(?:busy\s+)?\d+-core\s+(?:machine|VM|box)\b)",
    ))
)

# (path relative to the repository, text the match lies in, why it is no measurement)
ALLOWED = (
    ("powerinfer_tools/commands/profile.py", "Progress is saved every 30 seconds",
     "a setting of the command (how often it checkpoints), not a measurement"),
    ("solver/tiers.py", "A SATA link carries at most about 0.55 GB/s",
     "the SATA interface's ceiling (6 Gb/s less its 8b/10b encoding), a standard's figure that does not go stale"),
)


def prose(source: str):
    """(first line, text) for each comment block, standalone string and help string of a module's source."""
    yield from _comment_blocks(source)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield node.value.lineno, node.value.value
        elif isinstance(node, ast.Call):
            for keyword in node.keywords:
                if keyword.arg in HELP_KEYWORDS:
                    yield keyword.value.lineno, _literal_text(keyword.value)


def _comment_blocks(source: str):
    """Runs of comments on consecutive lines, joined, so that a figure broken over two lines is still one."""
    block: list[str] = []
    first = last = 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        line = token.start[0]
        if block and line != last + 1:
            yield first, "\n".join(block)
            block = []
        if not block:
            first = line
        block.append(token.string.lstrip("#"))
        last = line
    if block:
        yield first, "\n".join(block)


def _literal_text(node: ast.AST) -> str:
    """The literal parts of a string expression (an f-string's fields read as ``{}``, so no figure spans one)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)
    return " {} ".join(_literal_text(child) for child in ast.iter_child_nodes(node))


def findings(name: str, source: str) -> list[str]:
    """``name:line: match in line`` for each timed figure or machine name in a module's prose, less ALLOWED."""
    allowed = [re.escape(text) for file, text, _ in ALLOWED if file == name]
    found = []
    for first_line, text in sorted(prose(source)):
        spans = [m.span() for a in allowed for m in re.finditer(a, text)]
        lines = text.split("\n")
        for match in TIMED_FIGURE.finditer(text):
            if any(start <= match.start() < end for start, end in spans):
                continue
            offset = text.count("\n", 0, match.start())
            found.append(f"{name}:{first_line + offset}: {match.group()!r} in {lines[offset].strip()!r}")
    return found


def package_sources() -> dict[str, str]:
    """Path relative to the repository -> source, for every module of the package."""
    return {path.relative_to(REPO).as_posix(): path.read_text(encoding="utf-8")
            for folder in SOURCE_FOLDERS for path in sorted((REPO / folder).rglob("*.py"))}


def test_pattern_tells_figures_from_other_numbers():
    """The pattern's own cases: what it must flag and what it must leave alone."""
    for text in ("0.4 ms a token", "~20 us per call", "after 27 s", "2.4s before", "812.3 tok/s",
                 "~12 against ~25 GB/s", "40-50k reads/s", "30 G multiply-adds/s", "17,700/s",
                 "100 tokens per second", "1.9x llama.cpp", "0.85-0.99x", "~20x slower", "2x the speed",
                 "~10% faster", "on the EPYC", "a Xeon socket", "the development machine",
                 "the 2-core development VM", "the busy 2-core machine"):
        assert TIMED_FIGURE.search(text), text
    for text in ("a 2x2 matrix", "x86 and arm64", "hex 0x1F", "<0x{b:02X}>", "4 KiB pages", "a 2 MiB folio",
                 "~8x the work", "1.5x the neurons that fire", "store.x[layer]", "0s and 1s", "blk.N.x.npy",
                 "1536 x 576", "this machine's memory", "q4_0 rows", "AVX-512 VNNI", "128 tokens",
                 "GB/s (10^9 bytes per second)", "on a 2-core machine", "50% of the rows",
                 "``sparse <ratio>x dense's speed``"):
        assert not TIMED_FIGURE.search(text), text


def test_prose_is_comments_docstrings_and_help():
    """Each kind of prose is read, at the line the figure is on; code and other strings are not."""
    source = (
        '"""A module.\n\nIt took\n0.4 ms."""\n'
        'import click\n'
        'TIMEOUT = 30  # seconds, a setting\n'
        'LABEL = "not prose: 5 ms"\n'
        '# a comment broken over lines: 12\n'
        '# GB/s\n'
        '@click.option("--x", help=f"{TIMEOUT} s by default, 1.9x as fast")\n'
        'def f():\n'
        '    """On the EPYC."""\n'
    )
    assert findings("m.py", source) == [
        "m.py:4: '0.4 ms' in '0.4 ms.'",
        "m.py:8: '12\\n GB/s' in 'a comment broken over lines: 12'",
        "m.py:10: '1.9x' in '{} s by default, 1.9x as fast'",
        "m.py:12: 'EPYC' in 'On the EPYC.'",
    ]


def test_allowed_figures_are_still_there():
    """An exception whose text is gone is stale: it would let the next figure at that place through."""
    sources = package_sources()
    for file, text, _ in ALLOWED:
        assert any(text in prose_text for _, prose_text in prose(sources[file])), (file, text)


def test_no_timed_figures_in_package_prose():
    sources = package_sources()
    assert {name.split("/")[0] for name in sources} == set(SOURCE_FOLDERS)
    found = [f for name, source in sources.items() for f in findings(name, source)]
    assert not found, ("timed figures or machine names in docstrings, comments or help (they go stale: keep "
                       "the reason, point to docs/lab/ for the measurement):\n" + "\n".join(found))
