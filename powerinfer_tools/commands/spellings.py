"""How commands spell what they share, following llama.cpp's habits: the model as MODEL or ``-m/--model``, and the
old spellings of renamed options, still taken (hidden from the help) with a one-line note on stderr.

The renamed options (each command declares its own with ``renamed``): ``-f`` for ``--force`` (``-f`` is
llama.cpp's prompt file: ``run -f/--file``), ``solve --ctx`` for ``--ctx-size``, ``perplexity --sparse`` for
``--mode``, ``--split`` of a dataset for ``--dataset-split`` (``--split`` is the GPU split file of ``run`` and
``serve``). A light module: the commands that are not ``run`` do not import the runtime for it.
"""

from __future__ import annotations

import functools
from pathlib import Path

import click
from click.core import ParameterSource


def model_argument(default=None, kind: click.ParamType = click.Path(path_type=Path, exists=True),
                   required: bool = False):
    """MODEL as llama.cpp takes it too: the positional argument, or ``-m/--model`` (one of them, of ``kind``),
    passed on as ``model``: ``default`` when neither is given, unless one is ``required``."""

    def decorate(f):
        @functools.wraps(f)
        def with_model(*args, model, model_option, **kwargs):
            if model is not None and model_option is not None:
                raise click.UsageError("give the model once: as MODEL or as -m/--model")
            chosen = model if model is not None else model_option
            if chosen is None and required:
                raise click.UsageError("give the model: MODEL, or -m/--model MODEL")
            return f(*args, model=chosen if chosen is not None else default, **kwargs)

        with_model = click.option("-m", "--model", "model_option", type=kind, default=None, metavar="MODEL",
                                  help="The model, as llama.cpp's -m names it (instead of the MODEL argument).")(with_model)
        return click.argument("model", type=kind, default=None, required=False)(with_model)

    return decorate


def renamed(old: str, new: str, param: str):
    """``old``, a spelling of the option ``new`` (the parameter ``param``) that commands once had: still taken,
    hidden from the help, with a one-line note on stderr. Put it above the option it names."""
    dest = f"old_{param}_{old.lstrip('-').replace('-', '_')}"

    def decorate(f):
        current = next(p for p in f.__click_params__ if p.name == param)

        @functools.wraps(f)
        def with_old_spelling(*args, **kwargs):
            value = kwargs.pop(dest)
            ctx = click.get_current_context()
            if ctx.get_parameter_source(dest) is ParameterSource.COMMANDLINE:
                if ctx.get_parameter_source(param) is ParameterSource.COMMANDLINE:
                    raise click.UsageError(f"{old} is the old spelling of {new}: give {new} alone")
                click.echo(f"pitools: note: {old} is deprecated; use {new}", err=True)
                kwargs[param] = value
            return f(*args, **kwargs)

        flag = {"is_flag": True} if current.is_flag else {"type": current.type, "multiple": current.multiple}
        return click.option(old, dest, hidden=True, default=None, **flag)(with_old_spelling)

    return decorate
