"""Progress on stderr: a redrawn bar on a terminal, a line per quarter in a log."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    def __init__(
        self,
        total: int,
        label: str,
        *,
        unit: str = "",
        stream: TextIO | None = None,
        force: bool = False,
    ) -> None:
        self.total = max(total, 1)
        self.label = label
        self.unit = f" {unit}" if unit else ""
        self.done = 0
        self._stream = stream or sys.stderr
        self._tty = force or self._stream.isatty()
        self._quarter = 0
        self._started = time.perf_counter()

    def advance(self, n: int = 1, note: str = "") -> None:
        self.done += n
        elapsed = time.perf_counter() - self._started
        if not self._tty:
            # A log, not a terminal: one line per quarter instead of a redrawn bar.
            quarter = 4 * self.done // self.total
            if quarter > self._quarter:
                self._quarter = quarter
                self._stream.write(
                    f"{self.label}: {self.done}/{self.total}{self.unit} done, {elapsed:.1f}s\n"
                )
                self._stream.flush()
            return
        width = 30
        filled = int(width * self.done / self.total)
        bar = "█" * filled + "·" * (width - filled)
        self._stream.write(
            f"\r{self.label} [{bar}] {self.done}/{self.total}{self.unit} {elapsed:5.1f}s {note:<24}"
        )
        self._stream.flush()

    def finish(self) -> None:
        if self._tty:
            self._stream.write("\n")
            self._stream.flush()
