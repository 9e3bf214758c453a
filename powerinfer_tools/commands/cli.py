"""The ``pitools`` command line: one click group, one subcommand per pipeline step (each in ``commands/``)."""

from __future__ import annotations

import importlib
import os
import signal
import sys

import click

from powerinfer_tools import __version__
from powerinfer_tools.errors import Interrupted, PitoolsError


# Each subcommand: its module in commands/ and the click command there. A module is imported only when
# its command runs (or --help lists them all): `pitools run` does not pay for the imports of bench and
# synth (scipy, the reference engine's trainers), a large part of a warm start.
COMMANDS = {
    "advise": ("advise", "advise"),
    "pull": ("pull", "pull"),
    "convert": ("convert", "convert"),
    "bundle": ("bundle", "bundle"),
    "inspect": ("inspect", "inspect"),
    "profile": ("profile", "profile"),
    "train-predictors": ("train_predictors", "train_predictors"),
    "perplexity": ("perplexity", "perplexity"),
    "solve": ("solve", "solve"),
    "probe": ("solve", "probe"),
    "run": ("run", "run"),
    "serve": ("serve", "serve"),
    "synth": ("synth", "synth"),
    "bench": ("bench", "bench"),
}


def _interrupt_on_sigterm(signum, frame) -> None:
    raise Interrupted(signal_number=signum)


class _Group(click.Group):
    """Every failure is one ``pitools: error:`` line on stderr: a PitoolsError (exit status 1), a
    usage error that click would print as a usage block (exit 2), an interruption by Ctrl-C or
    SIGTERM (the shell's 128 + signal number). Subcommands are loaded as they are asked for (``COMMANDS``)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attribute = COMMANDS[name]
        return getattr(importlib.import_module(f"powerinfer_tools.commands.{module}"), attribute)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            status = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:  # bare `pitools`: the help, as click shows it
            exc.show()
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            usage = getattr(exc, "ctx", None)
            hint = f" (see '{usage.command_path} --help')" if isinstance(exc, click.UsageError) and usage else ""
            click.echo(f"pitools: error: {exc.format_message()}{hint}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:  # click's prompts turn Ctrl-C into Abort
            click.echo("pitools: error: interrupted", err=True)
            sys.exit(128 + signal.SIGINT)
        except BrokenPipeError:  # the reader of our output went away (`pitools run | head -1`)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        sys.exit(status if isinstance(status, int) else 0)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except PitoolsError as exc:
            # One line whatever the message quotes (a file's text, an exception's).
            click.echo(f"pitools: error: {' '.join(str(exc).split())}", err=True)
            sys.exit(1)
        except KeyboardInterrupt as exc:
            hint = getattr(exc, "hint", "")
            click.echo(f"pitools: error: interrupted{'; ' + hint if hint else ''}", err=True)
            sys.exit(128 + getattr(exc, "signal_number", signal.SIGINT))


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="pitools")
def cli() -> None:
    """Activation-sparse LLM inference: profile a ReLU-family model, train neuron
    predictors, place hot neurons on the GPU and run it hybrid CPU/GPU.

    \b
    Typical pipeline:
      pitools advise MODEL       will sparsity make it faster here? the numbers, and the command
      pitools pull ID            fetch a Hugging Face checkpoint
      pitools convert SRC        write a PowerInfer GGUF (profiling + predictors)
      pitools solve FILE --vram  write the GPU/CPU neuron split
      pitools run FILE -p TEXT   generate text
      pitools serve FILE         an OpenAI-compatible HTTP server
      pitools bundle FILE        one read per neuron, for run --ram (models larger than memory)
    """


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupt_on_sigterm)
    cli(prog_name="pitools")

