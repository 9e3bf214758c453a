"""The profile folder's report: firing density, hot-neuron share and never-fired neurons per layer
(``report.json``), their cumulative-share plot (``firing_cdf.png``), and PowerInfer's own
``activation_N.pt`` files exported from the stats."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from powerinfer_tools.formats.profile_folder import PLOT_FILE, REPORT_JSON, FiringStats, load_profile

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.fileio import atomic_output, check_output_folder, write_json

# The share of all firings whose carrying neurons PowerInfer's paper counts (its "hot" neurons).
HOT_SHARE = 0.8
# Layers drawn in the plot when there are too many for one curve each.
MAX_PLOTTED_LAYERS = 8


def hot_fraction(fire_count: np.ndarray, share: float = HOT_SHARE) -> float:
    """The smallest fraction of neurons that together carry ``share`` of all firings."""
    counts = np.sort(np.asarray(fire_count).ravel())[::-1]
    total = counts.sum()
    if total == 0:
        return 0.0
    k = int(np.searchsorted(np.cumsum(counts), share * total, side="left")) + 1
    return k / counts.size


def cumulative_share(fire_count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fraction of neurons, share of firings they carry), neurons sorted hottest first, from (0, 0)."""
    counts = np.sort(np.asarray(fire_count).ravel())[::-1].astype(np.float64)
    share = np.concatenate([[0.0], np.cumsum(counts) / max(counts.sum(), 1.0)])
    return np.arange(counts.size + 1) / counts.size, share


def firing_report(stats: FiringStats) -> dict:
    """Per layer and over the whole model: firing density per token, hot-neuron fraction, never-fired fraction."""
    tokens = max(stats.tokens, 1)

    def summary(counts: np.ndarray) -> dict:
        return {
            "density": float(counts.sum() / (tokens * counts.size)),
            "hot80_fraction": hot_fraction(counts),
            "never_fired": float(np.mean(counts == 0)),
        }

    return {
        "tokens": stats.tokens,
        "n_layers": stats.n_layers,
        "d_ff": int(stats.fire_count.shape[1]),
        "layers": [{"layer": i, **summary(c)} for i, c in enumerate(stats.fire_count)],
        "model": summary(stats.fire_count),
    }


def format_firing_report(report: dict, title: str = "") -> str:
    lines = [title] if title else []
    lines.append(f"{report['tokens']} tokens, {report['n_layers']} layers of {report['d_ff']} neurons")
    lines.append("layer   fires/token   neurons carrying 80% of firings   never fired")

    def row(name: str, r: dict) -> str:
        return f"{name:>5}   {r['density']:10.1%}   {r['hot80_fraction']:31.1%}   {r['never_fired']:11.1%}"

    lines += [row(str(r["layer"]), r) for r in report["layers"]]
    lines.append(row("all", report["model"]))
    lines.append("(PowerInfer's paper: 26% of neurons carry 80% of firings in an OPT-30B layer, "
                 "43% in LLaMA(ReGLU)-70B)")
    return "\n".join(lines)


def plotted_layers(n_layers: int) -> list[int]:
    if n_layers <= MAX_PLOTTED_LAYERS:
        return list(range(n_layers))
    return sorted({int(round(x)) for x in np.linspace(0, n_layers - 1, MAX_PLOTTED_LAYERS)})


def plot_firing_cdf(stats: FiringStats, path: Path, title: str) -> bool:
    """Write the cumulative-share plot; False (and no file) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never open a window
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 5))
    for i in plotted_layers(stats.n_layers):
        ax.plot(*cumulative_share(stats.fire_count[i]), lw=1.2, label=f"layer {i}")
    ax.plot(*cumulative_share(stats.fire_count), "k--", lw=1.5, label="whole model")
    ax.axhline(HOT_SHARE, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("fraction of neurons (sorted by firing frequency, hottest first)")
    ax.set_ylabel("share of all firings")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.01)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    with atomic_output(path, overwrite=True, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    return True


def write_report(folder: Path) -> tuple[dict, str]:
    """Write ``report.json`` and the plot beside the stats; return the report and its text form."""
    folder = Path(folder)
    meta, stats = load_profile(folder)
    report = firing_report(stats)
    report["model_name"] = meta.get("model")
    report["complete"] = meta["progress"]["complete"]
    title = f"profile of {meta.get('model')}"
    if not report["complete"]:
        title += f" (incomplete: {stats.tokens} of {meta['tokens']} tokens)"
    write_json(folder / REPORT_JSON, report)
    plotted = plot_firing_cdf(stats, folder / PLOT_FILE, title)
    text = format_firing_report(report, title)
    text += f"\nplot: {folder / PLOT_FILE}" if plotted else "\nplot: skipped (install matplotlib to draw it)"
    return report, text


def export_powerinfer_activations(stats: FiringStats, out: Path) -> list[Path]:
    """``activation_N.pt`` per layer, as PowerInfer's solver reads: a 1-D int64 tensor of firing counts.

    Needs torch, which is not a dependency of this package; the stats file itself
    is readable without it.
    """
    try:
        import torch
    except ImportError:
        raise PitoolsError("exporting PowerInfer's activation_N.pt files needs torch (pip install torch)") from None
    out = Path(out)
    check_output_folder(out)
    out.mkdir(exist_ok=True)
    paths = []
    for i, counts in enumerate(stats.fire_count):
        path = out / f"activation_{i}.pt"
        with atomic_output(path, overwrite=True, suffix=".pt") as tmp:
            torch.save(torch.from_numpy(counts.copy()), tmp)
        paths.append(path)
    return paths
