"""Profiling and predictor training on a Ray cluster of two nodes on this machine, against one process
(docs/how-to/scale-out.md).

    python examples/ray_scale_out.py [--layers 4] [--profile-tokens 2048] [--work DIR] [--json]

Needs the ray extra (pip install -e '.[ray]'). Steps:

1. ``pitools synth --shape tinyllama-1.1b --layers N --keep-work``: a model of TinyLlama's widths
   (d_model 2048, d_ff 5632) and its profile (reused from DIR when there);
2. a Ray cluster of two nodes of one CPU each (``tests/ray_cluster.py``: ``ray start`` with a temp folder
   and ports of its own);
3. per-task overhead, from this process: the first task (a worker process starts), then the round trip
   of an empty task (median of 20), and one layer's pairs put into the object store and read by a task
   pinned to the other node;
4. ``pitools train-predictors`` on the profile in one process, then with ``--ray``: wall times, seconds per
   layer, and whether the two folders hold the same bytes;
5. ``pitools profile`` of the synthetic checkpoint (the reference engine running the model, on the bundled
   held-out text, windows of 256 tokens) in one process, then with ``--ray`` (a task per window), then
   with ``--ray --layer-ranges 2`` (an actor holding each half of the layers): the same.

Every ``pitools`` process runs its BLAS on one thread, as each Ray task does (``ONE_THREAD``). On a
machine shared with other work the times vary; the load average is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the two-node cluster the tests start

from powerinfer_tools.formats.profile_folder import PAIRS_DIR, PairStore
from ray_cluster import two_nodes

from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.cluster.ray_session import ONE_THREAD

CLI = "from powerinfer_tools.commands.cli import main; main()"


def pitools(*args) -> tuple[float, str]:
    """Run ``pitools ARGS`` on one BLAS thread; its wall time and stderr."""
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", CLI, *map(str, args)], env={**os.environ, **ONE_THREAD["env_vars"]},
                            capture_output=True, text=True, check=False)
    if result.returncode:
        sys.exit(f"pitools {' '.join(map(str, args))} failed:\n{result.stderr}")
    return time.monotonic() - started, result.stderr


def task_overhead(address: str, profile: Path) -> dict:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        empty = ray.remote(num_cpus=1)(lambda: None)
        started = time.monotonic()
        ray.get(empty.remote())
        first = time.monotonic() - started
        trips = []
        for _ in range(20):
            started = time.monotonic()
            ray.get(empty.remote())
            trips.append(time.monotonic() - started)
        here = ray.get_runtime_context().get_node_id()
        other = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here)
        x = np.load(profile / PAIRS_DIR / PairStore.paths(Path(), 0)[0].name)
        started = time.monotonic()
        pairs = ray.put(x)
        put = time.monotonic() - started
        size = ray.remote(num_cpus=1, scheduling_strategy=NodeAffinitySchedulingStrategy(other, soft=False))(
            lambda a: getattr(a, "nbytes", 0))
        ray.get(size.remote(None))  # the other node's worker started before the transfer is timed
        started = time.monotonic()
        ray.get(size.remote(pairs))
        moved = time.monotonic() - started
        return {"first_task_s": first, "empty_task_round_trip_ms": 1000 * statistics.median(trips),
                "layer_pairs_mb": x.nbytes / 1e6, "put_s": put, "task_on_other_node_reading_them_s": moved}
    finally:
        ray.shutdown()


def compare_profiling(address: str, checkpoint: Path, tokens: int, work: Path) -> dict:
    """``pitools profile`` of ``checkpoint`` in one process, on the cluster (a task per window) and with a
    range of layers per node (``--layer-ranges 2``): wall times, and whether each wrote the same bytes."""
    args = (checkpoint, "--corpus", BUNDLED_MODEL / "heldout.txt", "--tokens", tokens, "--seq-len", 256, "--force", "-q")
    here, _ = pitools("profile", *args, "-o", work / "prof-here")
    results = {"profile_tokens": tokens, "profile_one_process_s": here}
    files = sorted(p.relative_to(work / "prof-here") for p in (work / "prof-here").rglob("*") if p.is_file())
    for name, ray in (("ray_two_nodes", ()), ("ray_layer_ranges_2", ("--layer-ranges", 2))):
        results[f"profile_{name}_s"], _ = pitools("profile", *args, "-o", work / f"prof-{name}", "--ray", address, *ray)
        results[f"profile_{name}_identical"] = all(
            (work / "prof-here" / f).read_bytes() == (work / f"prof-{name}" / f).read_bytes() for f in files)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--profile-tokens", type=int, default=2048)
    parser.add_argument("--work", type=Path, default=Path("/tmp/pitools-scale-out"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = args.work / f"tinyllama-{args.layers}.powerinfer.gguf"
    profile = Path(f"{model}.work") / "profile"
    if not profile.is_dir():
        pitools("synth", "--shape", "tinyllama-1.1b", "--layers", args.layers, "-o", model, "--keep-work", "-q",
                "--force")
    results = {"layers": args.layers, "load_average_before": os.getloadavg()[0]}
    with two_nodes({}) as address:
        results.update(task_overhead(address, profile))
        here, log = pitools("train-predictors", profile, "-o", args.work / "pred-here", "--force")
        cluster, _ = pitools("train-predictors", profile, "-o", args.work / "pred-ray", "--force", "--ray", address)
        results.update(compare_profiling(address, profile.parent / "checkpoint", args.profile_tokens, args.work))
    same = all((args.work / "pred-here" / name).read_bytes() == (args.work / "pred-ray" / name).read_bytes()
               for name in ("predictors.json", "predictors.safetensors"))
    results.update({"one_process_s": here, "ray_two_nodes_s": cluster, "identical": same,
                    "seconds_per_layer_one_process": [float(n) * (60 if unit == "min" else 1) for n, unit
                                                      in re.findall(r"^layer .* in ([\d.]+) (s|min), about", log, re.MULTILINE)],
                    "load_average_after": os.getloadavg()[0]})
    print(json.dumps(results, indent=2) if args.json else "\n".join(f"{k}: {v}" for k, v in results.items()))


if __name__ == "__main__":
    main()
