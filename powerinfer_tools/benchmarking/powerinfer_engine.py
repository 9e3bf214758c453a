"""PowerInfer's own runtime as a benchmark engine: its ``main`` (a CPU build of SJTU-IPADS/PowerInfer,
built by the user) on the same PowerInfer file, timed by the timings it prints.

Its ``main`` tokenizes text, so it is given the text of the benchmark's prompt tokens (which it
tokenizes back into the same ids for our files' BPE vocabularies; it adds BOS only for SentencePiece
ones) and generates ``--generate`` tokens greedily: PowerInfer has no teacher forcing, so its decoded
tokens are its own. Its ``llama_print_timings`` lines give the prompt's time and token count, and the
decoding steps' time and count (one fewer than the tokens generated: the first comes from the
prompt's logits), which are what its rates are computed from. It makes its own warm-up run (an
empty evaluation) before the timed ones.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from powerinfer_tools.benchmarking.machine import peak_rss
from powerinfer_tools.errors import PitoolsError

_PROMPT = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
_DECODE = re.compile(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs")


def parse_timings(output: str, binary: Path) -> tuple[float, int, float, int]:
    """Prompt seconds, prompt tokens, decoding seconds and decoding steps from ``llama_print_timings``
    lines, or a PitoolsError naming ``binary`` when they are missing."""
    prompt, decode = _PROMPT.search(output), _DECODE.search(output)
    if prompt is None or decode is None:
        raise PitoolsError(f"{binary}: printed no llama_print_timings \"prompt eval time\" and \"eval time\" "
                           "lines; is it PowerInfer's main?")
    return float(prompt[1]) / 1e3, int(prompt[2]), float(decode[1]) / 1e3, int(decode[2])


def check_executable(binary: Path) -> None:
    """Fail at once, before any engine runs, when ``binary`` cannot be run."""
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        raise PitoolsError(f"{binary}: no such executable (give --powerinfer the path of PowerInfer's main)")


def run_powerinfer(binary: Path, model: Path, prompt_text: str, generate: int, threads: int, context: int,
                   env: dict[str, str], launch=list) -> tuple[str, int]:
    """Run PowerInfer's ``main`` once; its output (stdout and stderr) and its peak RSS in bytes.
    ``launch`` turns the command line into the one to start (the bench's memory limit wraps it)."""
    # main writes main.log into its working directory: it runs in a scratch folder, not the user's.
    with tempfile.TemporaryDirectory(prefix="pitools-powerinfer-") as scratch:
        prompt_file = Path(scratch) / "prompt.txt"
        prompt_file.write_text(prompt_text, encoding="utf-8")
        command = [str(binary.resolve()), "-m", str(model.resolve()), "-f", str(prompt_file), "-n", str(generate),
                   "-t", str(threads), "-c", str(context), "--temp", "0", "--ignore-eos"]
        process = subprocess.Popen(launch(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   env={**os.environ, **env}, cwd=scratch)
        output: list[str] = []
        reader = threading.Thread(target=lambda: output.append(process.stdout.read()))
        reader.start()
        try:
            peak = _watch_peak_rss(process)
        finally:
            if process.poll() is None:  # interrupted: leave nothing running
                process.kill()
            reader.join()
            process.stdout.close()
    if process.returncode:
        tail = ("".join(output).strip().splitlines() or ["no output"])[-1]
        raise PitoolsError(f"{binary}: exit status {process.returncode} on {model}: {tail}")
    return "".join(output), peak


def _watch_peak_rss(process: subprocess.Popen, interval: float = 0.05) -> int:
    """The process's peak RSS, read until it exits (the last reading is the largest: VmHWM only grows)."""
    peak = 0
    while process.poll() is None:
        peak = max(peak, peak_rss(process.pid) or 0)
        time.sleep(interval)
    return peak
