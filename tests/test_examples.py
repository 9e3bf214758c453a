"""Scripts of examples/ whose numba loops call the package's kernel helpers directly run to their end on tiny
settings: a helper's changed signature breaks them where no other test looks (``prefetch_span`` gained its rows'
order, 2026-12-05, and ``examples/bench_kernels.py`` failed to compile until it was run by hand)."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.slow
@pytest.mark.parametrize("tables", [["--shapes", "tinyllama"],  # the default tables: shapes, tokens, interleaved, VNNI
                                    ["--shapes", "smollm2", "--only-decoder-axpy"],
                                    ["--shapes", "smollm2", "--only-prompt-bf16"]])
def test_the_kernel_benchmark_runs_its_tables(tables):
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "bench_kernels.py"), *tables, "--pool-mb", "4", "--repeats", "2",
         "--ref-repeats", "1"],
        capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(done.stdout.splitlines()) > 2, done.stdout  # the kernels' description, then a table's lines


@pytest.mark.slow
def test_the_decode_paths_example_decodes_alike_on_every_path(bundled_gguf):
    done = subprocess.run([sys.executable, str(EXAMPLES / "decode_paths.py"), str(bundled_gguf("f32")), "--steps", "4"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    decoded = [line.split("steps")[1] for line in lines if "argmax of the decoded steps" in line]
    assert lines[0].startswith("compiled decoder (ran: compiled decoder)") and len(decoded) == 3, done.stdout
    assert len(set(decoded)) == 1, done.stdout  # float32 weights: the same tokens on every path
    gap = next(line for line in lines if line.startswith("compiled decoder against general path"))
    assert float(gap.split()[-1]) < 1e-3, gap
