"""What a three-tier placement (``pitools solve --ram``) predicts: time per token, disk reads, the neuron
cache's hit rate, and memory by tier, as JSON (``--json``) and as text."""

from __future__ import annotations

import dataclasses
from typing import Any

from powerinfer_tools.solver.tier_ilp import TierSolveReport
from powerinfer_tools.solver.tiers import DEFAULT_DISK, TieredProblem, TierLayerCost, TierPrediction, bundle_bytes

from powerinfer_tools.units import format_size


def _ms(seconds: float) -> float:
    return round(float(seconds) * 1e3, 6)


def _rate(fired: float, misses: float) -> float | None:
    return round(1.0 - misses / fired, 6) if fired > 0 else None


def _layer_dict(index: int, cost: TierLayerCost, n_neurons: int) -> dict[str, Any]:
    return {
        "layer": index,
        "neurons": n_neurons,
        "gpu_neurons": int(cost.base.gpu_neurons),
        "ram_neurons": cost.ram_neurons,
        "disk_neurons": cost.disk_neurons,
        "dense_on_gpu": bool(cost.base.dense_on_gpu),
        "cache_hit_rate": _rate(cost.disk_fired, cost.disk_misses),
        "disk_reads_per_token": round(cost.disk_misses, 6),
        "dense_ms": _ms(cost.base.dense_s),
        "ffn_gpu_ms": _ms(cost.base.ffn_gpu_s),
        "ffn_cpu_ms": _ms(cost.base.ffn_cpu_s),
        "disk_ms": _ms(cost.disk_s),
        "sync_ms": _ms(cost.base.sync_s),
        "layer_ms": _ms(cost.total_s),
        "vram_bytes": int(cost.base.vram),
        "ram_bytes": int(cost.ram),
    }


def _memory(problem: TieredProblem, prediction: TierPrediction) -> dict[str, Any]:
    layers = prediction.layers
    ram = {
        "reserve": prediction.reserve_ram,
        "embeddings_and_head": prediction.head_ram,
        "dense": int(sum(c.dense_ram for c in layers)),  # attention, norms and predictors of CPU layers
        "kv_cache": int(sum(c.kv_ram for c in layers)),
        "ffn": int(sum(c.ffn_ram for c in layers)),  # the RAM tier
        "cache": int(sum(c.cache_ram for c in layers)),  # the disk tier's neuron caches
        "total": prediction.ram,
    }
    vram = None
    if problem.has_gpu:
        vram = {
            "reserve": prediction.reserve_vram,
            "dense": int(sum(c.base.dense_vram + c.base.predictor_vram for c in layers)),
            "kv_cache": int(sum(c.base.kv_vram for c in layers)),
            "ffn": int(sum(c.base.ffn_vram for c in layers)),
            "head": int(prediction.head.vram),
            "total": prediction.vram,
        }
    return {"ram_bytes": ram, "vram_bytes": vram}


def tier_summary_dict(problem: TieredProblem, report: TierSolveReport) -> dict[str, Any]:
    """Everything ``pitools solve --ram`` reports, JSON-ready (``--json``)."""
    prediction, disk = report.prediction, problem.disk
    fired = sum(c.disk_fired for c in prediction.layers)
    misses = sum(c.disk_misses for c in prediction.layers)
    largest = max(layer.neuron_bytes for layer in problem.layers)
    return {
        "objective": "latency",
        "hardware": dataclasses.asdict(problem.base.hardware),
        "disk": {"read_gbs": disk.read_gbs, "latency_us": disk.latency_us, "iops": disk.iops,
                 "defaulted": list(disk.defaulted), "bundle_bytes": bundle_bytes(largest),
                 "miss_us": round(disk.miss_seconds(largest) * 1e6, 3)},
        "budget_bytes": problem.base.budget_bytes if problem.has_gpu else None,
        "ram_budget_bytes": problem.ram_budget,
        "solve": {
            "solver": report.solver, "status": report.status, "seconds": round(report.seconds, 3),
            "value": report.value, "bound": report.bound, "bound_kind": report.bound_kind, "gap": report.gap,
            "cache_slots_tried": {str(k): None if v is None else _ms(v) for k, v in report.slots_tried.items()},
        },
        "placement": {
            "token_ms": _ms(prediction.token_s),
            "tokens_per_s": round(1.0 / prediction.token_s, 3),
            "disk_bytes_per_token": round(prediction.disk_read_bytes, 3),
            "disk_reads_per_token": round(misses, 6),
            "cache_hit_rate": _rate(fired, misses),
            "cache_slots": report.placement.cache_slots,
            "cache_bytes": report.placement.cache_bytes(problem),
            **_memory(problem, prediction),
            "layers": [_layer_dict(i, c, layer.n_neurons) for i, (c, layer) in
                       enumerate(zip(prediction.layers, problem.layers))],
            "head_on_gpu": prediction.head.on_gpu,
            "head_ms": _ms(prediction.head.total_s),
        },
    }


def _percent(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.1%}"


def _header_lines(summary: dict[str, Any]) -> list[str]:
    solve, hw, disk, ours = summary["solve"], summary["hardware"], summary["disk"], summary["placement"]
    tried = ", ".join(f"{k}: {'no fit' if v is None else f'{v:.4f} ms'}" for k, v in solve["cache_slots_tried"].items())
    tried = tried or "none, every neuron off the GPU fits in RAM"
    gpu = f"GPU {hw['gpu_bandwidth_gbs']:g} GB/s, " if summary["budget_bytes"] else ""
    lines = [
        (f"latency objective, three tiers, {solve['solver']}: {solve['status']} in {solve['seconds']:.2f} s; value "
         f"{solve['value'] * 1e3:.4f} ms/token, bound {solve['bound'] * 1e3:.4f} ms/token ({solve['bound_kind']}), "
         f"gap {solve['gap']:.3%}; cache slots per layer tried: {tried}"),
        f"hardware {hw['name']}: {gpu}CPU {hw['cpu_bandwidth_gbs']:g} GB/s",
        (f"disk {disk['read_gbs']:g} GB/s, {disk['latency_us']:g} us per read at depth 1, {disk['iops']:g} reads/s "
         f"in flight: a miss reads {format_size(disk['bundle_bytes'])}, {disk['miss_us']:g} us"),
    ]
    if disk["defaulted"]:
        lines.append(f"  (the hardware profile has no {', '.join(disk['defaulted'])}: defaults "
                     f"{', '.join(f'{k} = {DEFAULT_DISK[k]:g}' for k in disk['defaulted'])}, a slow SSD; measure "
                     "the disk with `pitools probe --disk MODEL` and pass the profile with --hardware)")
    if ours["vram_bytes"]:
        vram = ours["vram_bytes"]
        lines.append(f"VRAM {format_size(vram['total'])} of {format_size(summary['budget_bytes'])}: reserve "
                     f"{format_size(vram['reserve'])}, attention, norms and predictors {format_size(vram['dense'])}, "
                     f"KV cache {format_size(vram['kv_cache'])}, FFN {format_size(vram['ffn'])}, output head "
                     f"{format_size(vram['head'])}")
    ram = ours["ram_bytes"]
    lines.append(
        f"RAM {format_size(ram['total'])} of {format_size(summary['ram_budget_bytes'])}: embeddings and head "
        f"{format_size(ram['embeddings_and_head'])}, attention, norms and predictors {format_size(ram['dense'])}, "
        f"KV cache {format_size(ram['kv_cache'])}, RAM neurons {format_size(ram['ffn'])}, neuron cache "
        f"{format_size(ram['cache'])} ({ours['cache_slots']} slots per layer), reserve {format_size(ram['reserve'])}"
    )
    return lines


def tier_summary_text(summary: dict[str, Any]) -> str:
    """The human-readable report of ``tier_summary_dict``: one row per layer."""
    ours = summary["placement"]
    header = (f"{'layer':>5} {'GPU':>6} {'RAM':>6} {'disk':>6} {'dense':>5} {'hits':>6} {'reads':>8} "
              f"{'FFN GPU ms':>10} {'FFN CPU ms':>10} {'disk ms':>8} {'layer ms':>9} {'RAM':>10}")
    lines = [*_header_lines(summary), "", header]
    for row in ours["layers"]:
        lines.append(
            f"{row['layer']:>5} {row['gpu_neurons']:>6} {row['ram_neurons']:>6} {row['disk_neurons']:>6} "
            f"{'gpu' if row['dense_on_gpu'] else 'cpu':>5} {_percent(row['cache_hit_rate']):>6} "
            f"{row['disk_reads_per_token']:>8.2f} {row['ffn_gpu_ms']:>10.4f} {row['ffn_cpu_ms']:>10.4f} "
            f"{row['disk_ms']:>8.4f} {row['layer_ms']:>9.4f} {format_size(row['ram_bytes']):>10}"
        )
    lines.append(f"{'head':>5} {'':>20} {'gpu' if ours['head_on_gpu'] else 'cpu':>5} {'':>46} {ours['head_ms']:>9.4f}")
    lines.append(f"{'total':>5} {'':>73} {ours['token_ms']:>9.4f} {format_size(ours['ram_bytes']['total']):>10}")
    lines.append(
        f"\npredicted: {ours['tokens_per_s']:.2f} tokens/s; {format_size(ours['disk_bytes_per_token'])} read from "
        f"disk per token ({ours['disk_reads_per_token']:.1f} neuron reads), cache hit rate "
        f"{_percent(ours['cache_hit_rate'])}"
    )
    return "\n".join(lines)
