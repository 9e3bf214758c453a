"""``pitools solve``: place FFN neurons, dense blocks and the head on the GPU within a VRAM budget, and with
``--ram`` each neuron on the GPU, in RAM or on disk within a RAM budget too (or RAM and disk alone);
``pitools probe``: measure this machine's bandwidths into a hardware profile.

``solve`` takes the model's per-layer numbers from the model file, or from ``--stats FILE.npz``
(its arrays are the arguments of ``problem_from_stats``, listed in the command's help).
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import numpy as np

from powerinfer_tools.commands.spellings import model_argument, renamed
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.fileio import check_writable_output
from powerinfer_tools.formats.fingerprint import model_fingerprint
from powerinfer_tools.formats.gpu_split import SPLIT_SUFFIX, default_split_path
from powerinfer_tools.solver.disk_probe import check_disk_file
from powerinfer_tools.solver.hardware import (
    DEFAULT_PRESET,
    MIN_PROBE_BYTES,
    PRESETS,
    check_probe_size,
    load_profile,
    probe_profile,
    save_profile,
)
from powerinfer_tools.solver.ilp import OBJECTIVES, SOLVERS
from powerinfer_tools.solver.model_stats import read_embedding_stats, read_model_stats
from powerinfer_tools.solver.problem import (
    DEFAULT_RESERVE_BYTES,
    STATS_KEYS,
    problem_from_stats,
)
from powerinfer_tools.solver.split import solve_into, solve_tiers_into
from powerinfer_tools.solver.summary import summary_dict, summary_text
from powerinfer_tools.solver.tier_summary import tier_summary_dict, tier_summary_text
from powerinfer_tools.solver.tiers import EMBEDDING_STATS_KEYS, tiered_problem
from powerinfer_tools.units import format_size, parse_size


def read_stats_file(path: Path) -> dict[str, np.ndarray]:
    """The arrays of a ``--stats`` file (listed in the help of ``pitools solve``); the optional ones when present."""
    try:
        npz = np.load(path)
        if not isinstance(npz, np.lib.npyio.NpzFile):
            raise PitoolsError(f"{path}: holds a single array; --stats takes an .npz archive of named arrays")
        with npz:
            stats = {key: npz[key] for key in npz.files}
    except (OSError, ValueError) as exc:
        raise PitoolsError(f"{path}: cannot read stats file: {exc}") from exc
    missing = [key for key in STATS_KEYS if key not in stats]
    if missing:
        raise PitoolsError(f"{path}: stats file lacks {', '.join(missing)}; it needs {', '.join(STATS_KEYS)}")
    return {key: stats[key] for key in (*STATS_KEYS, *EMBEDDING_STATS_KEYS) if key in stats}


@click.command("solve", context_settings={"help_option_names": ["-h", "--help"]})
@model_argument(kind=click.Path(dir_okay=False, path_type=Path))
@click.option("--vram",
              help="GPU memory budget: 11GB, 11000MB (GB or G = 10^9 bytes), 11GiB (2^30 bytes).")
@click.option("--ram",
              help="Host memory budget: plan three tiers, each neuron on the GPU, resident in RAM, or on disk behind "
                   "its layer's neuron cache. It holds the token embeddings, the attention blocks and KV caches of "
                   "layers not on the GPU, the RAM neurons and the caches. Without --vram: RAM and disk alone (no GPU).")
@click.option("--ram-reserve", default="0B", show_default=True,
              help="Host memory of --ram kept for the process itself (interpreter, libraries, scratch).")
@click.option("--stats", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Per-layer firing probabilities and sizes (.npz) instead of the model file: the arrays listed above.")
@click.option("--hardware", default=DEFAULT_PRESET, show_default=True,
              help=f"Preset ({', '.join(PRESETS)}) or profile file (.toml/.json) from `pitools probe`.")
@renamed("--ctx", "--ctx-size", "ctx_size")
@click.option("-c", "--ctx-size", type=click.IntRange(1, 2**31 - 1), default=2048, show_default=True,
              help="Context length the KV cache is sized for (llama.cpp's n_ctx, a 32-bit integer).")
@click.option("--objective", type=click.Choice(OBJECTIVES), default="latency", show_default=True,
              help="latency: minimise predicted time per token; activations: maximise activation mass on the "
                   "GPU, as PowerInfer does.")
@click.option("--reserve", default=f"{DEFAULT_RESERVE_BYTES >> 20}MiB", show_default=True,
              help="GPU memory kept for the CUDA context and scratch buffers.")
@click.option("--min-share", type=click.FloatRange(0, 1), default=None,
              help="Least fraction of a split layer's neurons on the GPU [default: where a split saves "
                   "more than its sync cost].")
@click.option("--batch", type=click.IntRange(min=1), default=64, show_default=True,
              help="Neurons decided together (the ILP's granularity).")
@click.option("--solver", type=click.Choice(SOLVERS), default="auto", show_default=True,
              help="auto: HiGHS when highspy is installed, else CBC.")
@click.option("--gap", type=click.FloatRange(0, 1), default=0.005, show_default=True,
              help="Relative optimality gap at which the solver stops.")
@click.option("--time-limit", type=click.FloatRange(min=1), default=60.0, show_default=True,
              help="Seconds (with --ram, shared by the cache sizes tried).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help=f"Split file to write [default: MODEL{SPLIT_SUFFIX}, where PowerInfer looks for it].")
@click.option("--force", is_flag=True, help="Overwrite an existing output.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def solve(model: Path | None, vram: str | None, ram: str | None, ram_reserve: str, stats: Path | None, hardware: str,
          ctx_size: int, objective: str, reserve: str, min_share: float | None, batch: int, solver: str, gap: float,
          time_limit: float, output: Path | None, force: bool, as_json: bool) -> None:
    """Choose which FFN neurons (and which attention blocks) live on the GPU, and write the split
    file PowerInfer's runtime reads, MODEL.generated.gpuidx. With --ram, also which neurons stay
    resident in RAM and which are read from disk through a neuron cache (our keys in the same file);
    the disk's speed comes from the hardware profile (`pitools probe --disk MODEL`).

    --stats FILE.npz holds these arrays (sizes in bytes; one value, or one per layer):

    \b
      freqs               (n_layers, n_ff) probability that each FFN neuron fires on a token
      neuron_bytes        one neuron's rows of gate, up and down, as stored
      dense_bytes         attention weights and norms of a layer
      predictor_bytes     the neuron predictor of a layer (fc1 and fc2)
      kv_bytes_per_token  K and V of one token in a layer (times --ctx-size)
      head_bytes          output norm and output matrix
      hidden_bytes        one activation vector (n_embd x 4 for float32)
      embedding_bytes     optional, for --ram: the token embedding matrix [default: 0]
      embedding_in_head   optional, for --ram: 1 if the output matrix is the embedding matrix [default: 0]
    """
    if vram is None and ram is None:
        raise click.UsageError("give a budget: --vram SIZE (GPU memory), --ram SIZE (host memory), or both")
    if model is None and stats is None:
        raise PitoolsError("give a MODEL file, or --stats FILE.npz")
    if output is None:
        if model is None:
            raise PitoolsError("--stats without MODEL: name the split file with -o")
        output = default_split_path(model)
    check_writable_output(output, force, inputs=[p for p in (model, stats, Path(hardware)) if p is not None])
    budget_bytes = parse_size(vram, "--vram") if vram is not None else 0
    reserve_bytes = parse_size(reserve, "--reserve", minimum=0)
    ram_bytes = parse_size(ram, "--ram") if ram is not None else None
    ram_reserve_bytes = parse_size(ram_reserve, "--ram-reserve", minimum=0)
    if ram_bytes is not None and objective != "latency":
        raise PitoolsError(f"--objective {objective} places the GPU alone; with --ram the objective is latency")
    arrays = read_stats_file(stats) if stats else read_model_stats(model)
    embedding = {key: arrays.pop(key) for key in EMBEDDING_STATS_KEYS if key in arrays}
    problem = problem_from_stats(
        **arrays,
        n_ctx=ctx_size,
        budget_bytes=budget_bytes,
        hardware=load_profile(hardware),
        reserve_bytes=reserve_bytes,
        min_gpu_share=min_share,
    )
    # The split names its model file; with --stats, MODEL may be only the name of the split beside it.
    fingerprint = model_fingerprint(model) if model is not None and model.is_file() else None
    options = {"batch": batch, "solver": solver, "gap_rel": gap, "time_limit": time_limit}
    if ram_bytes is None:
        report = solve_into(problem, output, fingerprint, objective, overwrite=force, **options)
        summary, text = summary_dict(problem, report), summary_text
    else:
        tiered = tiered_problem(problem, ram_bytes, has_gpu=vram is not None, ram_reserve=ram_reserve_bytes,
                                **(embedding if stats else read_embedding_stats(model)))
        summary = tier_summary_dict(tiered, solve_tiers_into(tiered, output, fingerprint, overwrite=force, **options))
        text = tier_summary_text
    summary["output"] = str(output)
    click.echo(json.dumps(summary, indent=2) if as_json else f"{text(summary)}\nwrote {output}")


@click.command("probe", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=Path("hardware.toml"),
              show_default=True, help="Profile to write (.toml, or .json).")
@click.option("--base", type=click.Choice(sorted(PRESETS)), default=DEFAULT_PRESET, show_default=True,
              help="Preset giving what cannot be measured here: PCIe bandwidth, sync latency, and GPU "
                   "bandwidth when CuPy sees no GPU.")
@click.option("--size", default="1GiB", show_default=True,
              help=f"Bytes read per pass, from {format_size(MIN_PROBE_BYTES)} up to this machine's memory; "
                   "must exceed the last-level cache.")
@click.option("--repeats", type=click.IntRange(min=1), default=7, show_default=True,
              help="Passes; the median is kept.")
@click.option("--disk", type=click.Path(path_type=Path), default=None,
              help="Also measure the disk holding this file (a large one, e.g. the model) with direct I/O, past "
                   "the page cache: sequential GB/s, the latency of one 8 KiB random read, and such reads per "
                   "second with 8 in flight: what reading cold neurons from that disk costs.")
@click.option("--force", is_flag=True, help="Overwrite an existing output.")
def probe(output: Path, base: str, size: str, repeats: int, disk: Path | None, force: bool) -> None:
    """Measure memory bandwidth (CPU; GPU too through CuPy), and with --disk a disk's read speed, and
    write a hardware profile for --hardware."""
    check_writable_output(output, force)
    nbytes = check_probe_size(parse_size(size, "--size", minimum=0))  # which states the minimum, and why
    if disk is not None:
        check_disk_file(disk)
        click.echo(f"reading {disk} with direct I/O ...", err=True)
    click.echo(f"streaming {format_size(nbytes)} x {repeats} ...", err=True)
    profile = probe_profile(PRESETS[base], nbytes, repeats, disk)
    save_profile(profile, output, overwrite=force)
    click.echo(f"CPU {profile.cpu_bandwidth_gbs:g} GB/s, GPU {profile.gpu_bandwidth_gbs:g} GB/s "
               f"({profile.source})\nwrote {output}")
