"""What a benchmark records about the machine and its processes: the CPU model, and peak RSS."""

from __future__ import annotations

import subprocess
from pathlib import Path


def cpu_description() -> dict:
    """``lscpu``'s "Model name" and whether its flags list AMX (``amx_tile``): the project's machines
    are not all the same CPU, and llama.cpp's speed depends on which."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True,
                              env={"LC_ALL": "C", "PATH": "/usr/bin:/bin"}).stdout
    except (OSError, subprocess.CalledProcessError):
        text = ""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {"model": fields.get("Model name", "unknown (no lscpu)").strip(),
            "amx": "amx_tile" in fields.get("Flags", "").split()}


def peak_rss(pid: int | str = "self") -> int | None:
    """Peak resident set (VmHWM, bytes) of a process's memory map since its last exec, or None when
    it cannot be read (gone, or not Linux). Not ``ru_maxrss``: Linux carries the spawning process's
    peak over into a child's, so a worker would report its parent's size when that is larger."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith("VmHWM:")), None)
