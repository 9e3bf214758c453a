"""A real memory limit for one benchmarked process: a Linux memory cgroup of its own.

A limit given to an engine as a setting (ours: ``--ram``) proves nothing about what it does when
memory is short; a cgroup's limit holds for every engine alike and counts the page cache, so an
engine that memory-maps its model (llama.cpp, PowerInfer, our runtime without ``--ram``) is charged
for the file pages it keeps resident and must drop them to stay under it, as on a machine with that
much memory. Each run gets a fresh group under the caller's own (cgroup v2's ``memory.max``, or v1's
``memory.limit_in_bytes``); the process joins it before it runs anything (``MemoryLimit.command``). Swap is excluded where the controller allows it, so the limit is not met by swapping.
This needs write access to the cgroup tree (root, or a delegated subtree).
"""

from __future__ import annotations

import secrets
from pathlib import Path

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.units import format_size

CGROUP_ROOT = Path("/sys/fs/cgroup")


class MemoryLimitExceeded(PitoolsError):
    """An engine's process was killed by the kernel for exceeding its group's limit."""


def _own_memory_cgroup() -> tuple[Path, int]:
    """The folder of this process's memory cgroup and the controller's version (2 or 1)."""
    v1_path = v2_path = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            v2_path = path
        elif "memory" in controllers.split(","):
            v1_path = path
    if v1_path is not None and (CGROUP_ROOT / "memory").is_dir():
        return CGROUP_ROOT / "memory" / v1_path.lstrip("/"), 1
    if v2_path is not None and (CGROUP_ROOT / "cgroup.controllers").is_file():
        return CGROUP_ROOT / v2_path.lstrip("/"), 2
    raise PitoolsError("--memory-limit: this system has no memory cgroup controller mounted at /sys/fs/cgroup")


class MemoryLimit:
    """A memory cgroup limited to ``limit_bytes``; ``close`` removes it (its processes must have exited)."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        parent, self.version = _own_memory_cgroup()
        self.path = parent / f"pitools-bench-{secrets.token_hex(4)}"
        try:
            self.path.mkdir()
            if self.version == 2:
                self._write("memory.max", limit_bytes)
                self._write_if_present("memory.swap.max", 0)
            else:
                self._write("memory.limit_in_bytes", limit_bytes)
                self._write_if_present("memory.memsw.limit_in_bytes", limit_bytes)
        except OSError as exc:
            self.close()
            raise PitoolsError(f"--memory-limit: cannot make a memory cgroup under {parent}: {exc.strerror} "
                               "(it needs root, or a cgroup subtree delegated to this user)") from exc

    def command(self, command: list[str]) -> list[str]:
        """``command`` started inside the group: a shell that moves itself into it, then execs the
        command (a ``preexec_fn`` would do the same in Python, which is unsafe in a threaded parent)."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *command]

    def oom_kills(self) -> int:
        """How many of the group's processes the kernel killed for exceeding the limit."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def describe(self) -> str:
        return f"{format_size(self.limit_bytes)} (cgroup v{self.version}, page cache counted)"

    def close(self) -> None:
        try:
            self.path.rmdir()
        except FileNotFoundError:
            pass

    def _write(self, name: str, value: int) -> None:
        (self.path / name).write_text(str(value))

    def _write_if_present(self, name: str, value: int) -> None:
        if (self.path / name).exists():
            self._write(name, value)
