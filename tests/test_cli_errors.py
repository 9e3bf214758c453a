"""Usage errors that click would print as a usage block are one `pitools: error:` line too."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from powerinfer_tools.commands.cli import cli


@pytest.mark.parametrize("args, match", [
    (["run", "--temp", "abc"], "'abc' is not a valid float"),
    (["run", "--threads", "0"], "--threads"),
    (["run", "--no-such-option"], "No such option"),
    (["solve", "--ctx-size", "0", "--vram", "1GB"], "--ctx-size"),
    (["solve", "--ctx", "0", "--vram", "1GB"], "--ctx"),  # the old spelling, checked as the new one is
    (["no-such-command"], "No such command"),
])
def test_a_usage_error_is_one_line_with_exit_status_2(args, match):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stderr.startswith("pitools: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert match in result.stderr and "--help" in result.stderr, result.stderr


def test_help_and_version_still_exit_0():
    for args in (["--help"], ["run", "--help"], ["--version"]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0 and result.stdout and not result.stderr, args


def test_bare_pitools_shows_the_help():
    result = CliRunner().invoke(cli, [])
    assert "Usage: " in result.output and "COMMAND [ARGS]" in result.output and "pitools: error" not in result.output
