"""``pitools bundle``: rewrite a PowerInfer file in the bundled FFN layout (one read per neuron)."""

from __future__ import annotations

from pathlib import Path

import click

from powerinfer_tools.commands.spellings import model_argument, renamed
from powerinfer_tools.conversion.bundle import bundle_model, bundled_path
from powerinfer_tools.units import format_size


@click.command("bundle")
@model_argument(kind=click.Path(path_type=Path, dir_okay=False, exists=True), required=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Output file [default: MODEL with .bundled before .powerinfer.gguf].")
@renamed("-f", "--force", "force")
@click.option("--force", is_flag=True, help="Overwrite OUTPUT if it exists.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or messages on stderr.")
def bundle(model: Path, output: Path | None, force: bool, quiet: bool) -> None:
    """Write MODEL (a PowerInfer file) with each neuron's gate, up and ffn_down_t rows side by side.

    For `pitools run --ram`: a neuron read from disk is then one direct read of one aligned row
    instead of three (PowerInfer-2's and "LLM in a flash"'s bundling). Every other tensor and key is
    copied as it is and nothing is re-quantized, so the bundled file computes exactly what MODEL
    computes; our runtime reads both layouts, PowerInfer's reads only MODEL's. See
    formats/README.md, "Bundled FFN layout". The output path is printed on stdout.

    \b
    Example:
      pitools bundle model.powerinfer.gguf && pitools run model.bundled.powerinfer.gguf --ram 2GB
    """
    output = output if output is not None else bundled_path(model)
    layout = bundle_model(model, output, force=force, progress=not quiet)
    if not quiet:
        padding = layout.stride - sum(p.nbytes for p in layout.parts)
        click.echo(f"wrote bundled layout, {format_size(layout.stride)} per neuron ({padding} bytes of alignment "
                   f"padding): {output}", err=True)
    click.echo(str(output))
