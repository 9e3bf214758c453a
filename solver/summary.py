"""What a solved placement predicts, beside a layer-granular offload of the same budget.

The comparison is llama.cpp's ``-ngl N``: the last ``N`` whole layers (dense block, KV cache
and every FFN neuron) on the GPU, then the output head once all layers fit. It is priced
twice: on this model with the same sparse FFN execution as ours, which isolates what
neuron-level placement gains, and as llama.cpp runs it (every neuron computed, no
predictors, so layers are smaller and more of them may fit).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from powerinfer_tools.solver.ilp import SolveReport
from powerinfer_tools.solver.problem import Placement, PlacementProblem, Prediction, predict

from powerinfer_tools.units import format_size


def layer_granular_placement(problem: PlacementProblem) -> Placement:
    """The whole layers, from the last one back, then the head, that fit in the budget."""
    n_layers = len(problem.layers)
    free = problem.budget_bytes - problem.reserve_bytes
    on_gpu = [False] * n_layers
    for index in reversed(range(n_layers)):
        layer = problem.layers[index]
        size = layer.block_bytes + layer.n_neurons * layer.neuron_bytes
        if size > free:
            break
        free -= size
        on_gpu[index] = True
    return Placement(
        gpu_neurons=tuple(layer.n_neurons if gpu else 0 for layer, gpu in zip(problem.layers, on_gpu)),
        dense_on_gpu=tuple(on_gpu),
        head_on_gpu=all(on_gpu) and problem.head_bytes <= free,
    )


def _n_gpu_layers(placement: Placement) -> int:
    """llama.cpp's ``-ngl`` value: offloaded layers, plus one for the output head."""
    return sum(placement.dense_on_gpu) + placement.head_on_gpu


def _ms(seconds: float) -> float:
    return round(float(seconds) * 1e3, 6)


def _placement_dict(problem: PlacementProblem, prediction: Prediction) -> dict[str, Any]:
    layers = prediction.layers
    return {
        "token_ms": _ms(prediction.token_s),
        "tokens_per_s": round(1.0 / prediction.token_s, 3),
        "gpu_read_fraction": round(prediction.gpu_read_bytes / prediction.read_bytes, 6),
        "vram_bytes": {
            "reserve": prediction.reserve_vram,
            "dense": int(sum(c.dense_vram for c in layers)),
            "predictors": int(sum(c.predictor_vram for c in layers)),
            "kv_cache": int(sum(c.kv_vram for c in layers)),
            "ffn": int(sum(c.ffn_vram for c in layers)),
            "head": prediction.head.vram,
            "total": prediction.vram,
        },
        "layers": [
            {
                "layer": index,
                "neurons": layer.n_neurons,
                "gpu_neurons": int(cost.gpu_neurons),
                "dense_on_gpu": bool(cost.dense_on_gpu),
                "dense_ms": _ms(cost.dense_s),
                "ffn_gpu_ms": _ms(cost.ffn_gpu_s),
                "ffn_cpu_ms": _ms(cost.ffn_cpu_s),
                "sync_ms": _ms(cost.sync_s),
                "layer_ms": _ms(cost.total_s),
                "vram_bytes": int(cost.vram),
            }
            for index, (layer, cost) in enumerate(zip(problem.layers, layers))
        ],
        "head_on_gpu": prediction.head.on_gpu,
        "head_ms": _ms(prediction.head.total_s),
    }


def summary_dict(problem: PlacementProblem, report: SolveReport) -> dict[str, Any]:
    """Everything ``pitools solve`` reports, JSON-ready (``--json``)."""
    ngl = layer_granular_placement(problem)
    dense_model = problem.as_dense_model()
    llama_ngl = layer_granular_placement(dense_model)
    llama = predict(dense_model, llama_ngl)
    return {
        "objective": report.objective,
        "hardware": dataclasses.asdict(problem.hardware),
        "budget_bytes": problem.budget_bytes,
        "solve": {
            "solver": report.solver,
            "status": report.status,
            "seconds": round(report.seconds, 3),
            "value": report.value,
            "bound": report.bound,
            "bound_kind": report.bound_kind,
            "gap": report.gap,
        },
        "placement": _placement_dict(problem, report.prediction),
        "layer_granular": {"n_gpu_layers": _n_gpu_layers(ngl), **_placement_dict(problem, predict(problem, ngl))},
        "llama_cpp": {
            "n_gpu_layers": _n_gpu_layers(llama_ngl),
            "token_ms": _ms(llama.token_s),
            "tokens_per_s": round(1.0 / llama.token_s, 3),
        },
    }


def _value_text(objective: str, value: float) -> str:
    return f"{value * 1e3:.4f} ms/token" if objective == "latency" else f"{format_size(value)}/token read on the GPU"


def summary_text(summary: dict[str, Any]) -> str:
    """The human-readable report of ``summary_dict``: one row per layer, ours beside -ngl."""
    solve, ours, ngl, hw = summary["solve"], summary["placement"], summary["layer_granular"], summary["hardware"]
    llama = summary["llama_cpp"]
    vram = ours["vram_bytes"]
    title = (
        f"{summary['objective']} objective, {solve['solver']}: {solve['status']} in {solve['seconds']:.2f} s; "
        f"value {_value_text(summary['objective'], solve['value'])}, bound "
        f"{_value_text(summary['objective'], solve['bound'])} ({solve['bound_kind']}), gap {solve['gap']:.3%}"
    )
    hardware = (
        f"hardware {hw['name']}: GPU {hw['gpu_bandwidth_gbs']:g} GB/s, CPU {hw['cpu_bandwidth_gbs']:g} GB/s, "
        f"PCIe {hw['pcie_bandwidth_gbs']:g} GB/s, sync {hw['sync_latency_us']:g} us"
    )
    memory = (
        f"VRAM {format_size(vram['total'])} of {format_size(summary['budget_bytes'])}: reserve "
        f"{format_size(vram['reserve'])}, attention and norms {format_size(vram['dense'])}, predictors "
        f"{format_size(vram['predictors'])}, KV cache {format_size(vram['kv_cache'])}, FFN {format_size(vram['ffn'])}, "
        f"output head {format_size(vram['head'])}"
    )
    header = (
        f"{'layer':>5} {'GPU neurons':>18} {'dense':>5} {'FFN GPU ms':>10} {'FFN CPU ms':>10} {'layer ms':>9} "
        f"{'VRAM':>10} | {'on GPU':>6} {'layer ms':>9}"
    )
    lines = [title, hardware, memory, "",
             f"{'this placement':<{header.index('|')}}| -ngl {ngl['n_gpu_layers']} (whole layers)", header]
    for mine, theirs in zip(ours["layers"], ngl["layers"]):
        share = mine["gpu_neurons"] / mine["neurons"]
        lines.append(
            f"{mine['layer']:>5} {mine['gpu_neurons']:>7}/{mine['neurons']:<5} {share:>4.0%} "
            f"{'gpu' if mine['dense_on_gpu'] else 'cpu':>5} {mine['ffn_gpu_ms']:>10.4f} {mine['ffn_cpu_ms']:>10.4f} "
            f"{mine['layer_ms']:>9.4f} {format_size(mine['vram_bytes']):>10} | "
            f"{'yes' if theirs['dense_on_gpu'] else 'no':>6} {theirs['layer_ms']:>9.4f}"
        )
    lines.append(
        f"{'head':>5} {'':>18} {'gpu' if ours['head_on_gpu'] else 'cpu':>5} {'':>21} {ours['head_ms']:>9.4f} "
        f"{format_size(vram['head']):>10} | {'yes' if ngl['head_on_gpu'] else 'no':>6} {ngl['head_ms']:>9.4f}"
    )
    lines.append(
        f"{'total':>5} {'':>46} {ours['token_ms']:>9.4f} {format_size(vram['total']):>10} | {'':>6} "
        f"{ngl['token_ms']:>9.4f}"
    )
    lines.append(
        f"\npredicted: {ours['tokens_per_s']:.2f} tokens/s with this placement ({ours['gpu_read_fraction']:.1%} of "
        f"the bytes read come from the GPU); {ngl['tokens_per_s']:.2f} tokens/s with -ngl {ngl['n_gpu_layers']} and "
        f"the same sparse FFN; {llama['tokens_per_s']:.2f} tokens/s for llama.cpp, dense with -ngl "
        f"{llama['n_gpu_layers']}"
    )
    return "\n".join(lines)
