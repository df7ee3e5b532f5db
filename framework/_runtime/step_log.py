"""Start-up work that takes more than a moment says so in the log, and how far it got.

A data node prefaulting its memory, a file node reserving its files, an index preparing its
lookup image, a node scanning its memory for records: each can take from a second to
minutes, and a process that prints nothing meanwhile looks hung. :class:`StepLog` wraps such
a step: once it has run for ``after`` seconds it logs what it is doing, then every ``every``
seconds how far it got (a share of ``total`` where the step reports its progress with
:meth:`StepLog.advance`, else the time so far), and when it ends how long it took. A step
that ends within ``after`` logs nothing, so small stores and tests start as quietly as before.

The lines come from a timer thread of the step's own, so the work itself only adds to a
counter (once per piece of work, not per byte).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType

__all__ = ["StepLog"]


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class StepLog:
    """Logs a slow step's start, progress and end on ``logger`` at INFO; a context manager."""

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        total: int = 0,
        describe: Callable[[float], str] = _bytes,
        after: float = 1.0,
        every: float = 5.0,
    ) -> None:
        """``what``: the step, as a phrase ("preparing 4.0 GiB of memory"); ``total``: the
        amount of work (0: not known, only the time is shown); ``describe``: how an amount
        reads (bytes by default)."""
        self.logger = logger
        self.what = what
        self.total = total
        self._describe = describe
        self._after = after
        self._every = every
        self._done = 0
        self._lock = threading.Lock()
        self._ended = threading.Event()
        self._spoke = False
        self._started = 0.0
        self._thread: threading.Thread | None = None

    def advance(self, amount: int) -> None:
        """``amount`` more of the work is done (thread-safe)."""
        with self._lock:
            self._done += amount

    def _progress(self) -> str:
        elapsed = time.monotonic() - self._started
        with self._lock:
            done = self._done
        if self.total > 0:
            share = 100.0 * min(done, self.total) / self.total
            return (
                f"{share:.0f}% ({self._describe(done)} of {self._describe(self.total)}), "
                f"{elapsed:.1f} s so far"
            )
        return f"{elapsed:.1f} s so far"

    def _watch(self) -> None:
        if self._ended.wait(self._after):
            return
        self._spoke = True
        self.logger.info("%s: %s", self.what, self._progress())
        while not self._ended.wait(self._every):
            self.logger.info("%s: %s", self.what, self._progress())

    def __enter__(self) -> StepLog:
        self._started = time.monotonic()
        if self.logger.isEnabledFor(logging.INFO):
            self._thread = threading.Thread(
                target=self._watch, name="kvfabric-step-log", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._ended.set()
        if self._thread is not None:
            self._thread.join()
        if self._spoke:
            elapsed = time.monotonic() - self._started
            outcome = "done" if exc_type is None else "failed"
            self.logger.info("%s: %s in %.1f s", self.what, outcome, elapsed)
