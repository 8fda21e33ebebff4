"""A plain stderr progress bar (no dependencies).

On a terminal the bar redraws in place; otherwise it prints one line per 10%
so that logs stay short. Disabled bars cost nothing.
"""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, *, label: str = "simulate", enabled: bool = True,
                 stream=None, width: int = 30):
        self.total = max(int(total), 1)
        self.done = 0
        self.label = label
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self._last_decile = -1

    def set_label(self, label: str) -> None:
        self.label = label
        self._draw(force=True)

    def update(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        self._draw()

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        frac = self.done / self.total
        decile = int(frac * 10)
        if not self.tty and not force and decile == self._last_decile:
            return
        self._last_decile = decile
        fill = int(frac * self.width)
        bar = "#" * fill + "." * (self.width - fill)
        line = (f"[{bar}] {frac * 100:5.1f}% {self.done}/{self.total} "
                f"{time.perf_counter() - self.t0:6.1f}s {self.label}")
        if self.tty:
            self.stream.write("\r" + line[:120].ljust(120))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
