"""docs/reference/cli.md, made from the commands themselves: ``python -m powerinfer_tools.commands.reference``.

Each command's ``--help``, as ``pitools COMMAND --help`` prints it at a fixed width, so that the page is the help
word for word (tests/test_docs.py checks it is current).
"""

from __future__ import annotations

import click

from powerinfer_tools.commands.cli import cli

WIDTH = 100  # columns the help is wrapped at, whatever the terminal making the page

PREAMBLE = """# Command-line reference

Every `pitools` command's `--help`, word for word. Made by `python -m powerinfer_tools.commands.reference`;
a test keeps it current. Sizes (`--vram`, `--ram`, ...) are bytes with a unit: `K`, `M`, `G`, `T` (with or
without `B`) are powers of 1000, `KiB`, `MiB`, `GiB`, `TiB` powers of 1024.
"""


def _root_context() -> click.Context:
    """``pitools``'s context as its invocation makes it (its settings: ``-h`` beside ``--help``, which the
    commands' contexts inherit), ``WIDTH`` columns wide."""
    return click.Context(cli, info_name="pitools", terminal_width=WIDTH, max_content_width=WIDTH, **cli.context_settings)


def help_text(command: click.Command, name: str) -> str:
    """``pitools NAME --help`` as click prints it ``WIDTH`` columns wide."""
    with _root_context() as parent:
        with click.Context(command, info_name=name, parent=parent, terminal_width=WIDTH,
                           max_content_width=WIDTH) as ctx:
            return command.get_help(ctx)


def page() -> str:
    """The whole reference page: ``pitools --help``, then each command's."""
    with _root_context() as ctx:
        sections = [PREAMBLE, "## pitools\n\n```text\n" + cli.get_help(ctx) + "\n```\n"]
        for name in cli.list_commands(ctx):
            command = cli.get_command(ctx, name)
            sections.append(f"## pitools {name}\n\n```text\n{help_text(command, name)}\n```\n")
    return "\n".join(sections)


if __name__ == "__main__":
    print(page(), end="")
