"""The ``pitools`` command line: one click group, one subcommand per pipeline step."""

from __future__ import annotations

import sys

import click

from . import __version__
from .errors import PitoolsError


class _Group(click.Group):
    """Turns PitoolsError into one line on stderr and exit status 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except PitoolsError as exc:
            click.echo(f"pitools: error: {exc}", err=True)
            sys.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="pitools")
def cli() -> None:
    """Activation-sparse LLM inference: profile a ReLU-family model, train neuron
    predictors, place hot neurons on the GPU and run it hybrid CPU/GPU.

    \b
    Typical pipeline:
      pitools pull ID            fetch a Hugging Face checkpoint
      pitools convert SRC        write a PowerInfer GGUF (profiling + predictors)
      pitools solve FILE --vram  write the GPU/CPU neuron split
      pitools run FILE -p TEXT   generate text
    """


def main() -> None:
    cli(prog_name="pitools")


# Subcommands register themselves below; each lives in its own module.

from .commands.pull import pull  # noqa: E402

cli.add_command(pull)

from .commands.run import run  # noqa: E402

cli.add_command(run)

from .commands.convert import convert  # noqa: E402

cli.add_command(convert)

from .commands.inspect import inspect  # noqa: E402

cli.add_command(inspect)

from .commands.profile import profile  # noqa: E402

cli.add_command(profile)

from .commands.train_predictors import train_predictors  # noqa: E402

cli.add_command(train_predictors)

from .commands.perplexity import perplexity  # noqa: E402

cli.add_command(perplexity)

from .commands.solve import probe, solve  # noqa: E402

cli.add_command(solve)
cli.add_command(probe)

from .commands.synth import synth  # noqa: E402

cli.add_command(synth)

from .commands.bench import bench  # noqa: E402

cli.add_command(bench)
