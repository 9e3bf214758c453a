"""Progress on long work: a live bar on a terminal, one line per stage anywhere else.

A tqdm bar redraws itself with carriage returns; written to a log file or a pipe that
becomes one endless line, with the command's last message appended to it. So the bar is
drawn only when stderr is a terminal; otherwise a stage prints one line when it starts and
one when it ends, and messages (``write``) are ordinary lines.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


def progress_bar(*, total: int, desc: str, unit: str = "it", initial: int = 0, enabled: bool = True,
                 unit_scale: bool = False, leave: bool = True):
    """A bar over ``total`` units (``update(n)``, ``set_description``, ``write``, context manager)."""
    if enabled and sys.stderr.isatty():
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, unit_scale=unit_scale, leave=leave,
                    file=sys.stderr, dynamic_ncols=True)
    return StageLines(total=total, desc=desc, unit=unit, initial=initial, enabled=enabled, unit_scale=unit_scale)


class StageLines:
    """The non-terminal stand-in for a bar: a line at the start and at the end of the stage."""

    def __init__(self, *, total: int, desc: str, unit: str, initial: int, enabled: bool, unit_scale: bool):
        self.total, self.n, self.desc, self.unit = total, initial, desc, unit
        self.enabled, self.unit_scale = enabled, unit_scale
        self._started = time.monotonic()
        self._closed = False
        resumed = f", resuming at {self._quantity(initial)}" if initial else ""
        self._line(f"{desc}: {self._quantity(total)}{resumed}")

    def _quantity(self, n: float) -> str:
        return tqdm.format_sizeof(n, self.unit) if self.unit_scale else f"{n} {self.unit}"

    def _line(self, text: str) -> None:
        if self.enabled:
            print(text, file=sys.stderr, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_description(self, desc: str) -> None:
        """Ignored: per-item descriptions (one per tensor) would be one line each."""

    def write(self, message: str) -> None:
        self._line(message)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            elapsed = time.monotonic() - self._started
            self._line(f"{self.desc}: {self._quantity(self.n)} of {self._quantity(self.total)} in {elapsed:.1f} s")

    def __enter__(self) -> "StageLines":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
