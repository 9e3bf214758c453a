"""``pitools pull``: turn a hub id or a folder into a local checkpoint folder."""

from __future__ import annotations

from pathlib import Path

import click

from powerinfer_tools.checkpoints.hub import resolve_checkpoint


@click.command("pull", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("id_or_path", metavar="ID_OR_PATH")
@click.option(
    "--revision",
    metavar="REV",
    default=None,
    help="Branch, tag or commit of the hub repository (default: main).",
)
@click.option(
    "--local-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Download into this folder instead of the Hugging Face cache.",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress messages or bars on stderr.")
def pull(id_or_path: str, revision: str | None, local_dir: Path | None, quiet: bool) -> None:
    """Fetch a Hugging Face checkpoint and print its local folder.

    ID_OR_PATH is a hub id (org/name) or a local checkpoint folder. A folder
    (a path starting with ., / or ~, or one that exists) is only checked for a
    config.json and printed back. For a hub id only what conversion reads is
    downloaded: config.json, generation_config.json, the tokenizer files and
    the weights -- *.safetensors when the repository has them, *.bin
    otherwise. An interrupted download resumes where it stopped.

    The folder path goes to stdout, progress to stderr, so scripts can use
    $(pitools pull ID). Files go to the Hugging Face cache (HF_HOME, HF_HUB_CACHE)
    unless --local-dir is given. With HF_HUB_OFFLINE=1 nothing is downloaded:
    the cached copy is used, or the command fails. With no network it fails at
    once; HF_HUB_ETAG_TIMEOUT sets the seconds to wait for the hub (default 10).
    Private and gated repositories need `hf auth login` or HF_TOKEN.

    \b
    Examples:
      pitools pull SparseLLM/ReluLLaMA-7B
      pitools pull SparseLLM/ReluLLaMA-7B --revision main --local-dir ./relullama
      pitools convert "$(pitools pull SparseLLM/ReluLLaMA-7B)"
      HF_HUB_OFFLINE=1 pitools pull SparseLLM/ReluLLaMA-7B   # cache only
    """
    folder = resolve_checkpoint(id_or_path, revision=revision, local_dir=local_dir, progress=not quiet)
    click.echo(str(folder))
