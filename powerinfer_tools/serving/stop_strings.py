"""Ending generated text at a stop string, which may span token boundaries."""

from __future__ import annotations


class StopStrings:
    """Text pieces in, text out up to (not including) the first stop string.

    A piece's end that could be the start of a stop string is held back until the next piece tells
    whether it is one: ``feed`` returns only text that can no longer become part of a stop string.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """The text that is safe to release after ``piece``; nothing once a stop string was seen."""
        if self.stopped:
            return ""
        text = self.held + piece
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped, self.held = True, ""
            return text[: min(found)]
        keep = self._partial_stop_at_end(text)
        self.held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """What is held back when generation ends without a stop string: it is text after all."""
        text, self.held = self.held, ""
        return "" if self.stopped else text

    def _partial_stop_at_end(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
