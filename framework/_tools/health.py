"""Whether a server process is ready to serve, as ``/readyz`` on its ``--metrics-port`` says.

A process adds one named check per thing it needs before it is of use: a controller that it
listens and that its index answers; a data node that its memory is prepared, that it is
registered, and that its controller (or shared index) answers its heartbeats. A check is a
callable returning None when it holds, else a short reason a person can act on ("not
registered with the controller at tcp://10.0.0.1:7100 yet"). The process is ready when
every check holds. Checks are read from the HTTP server's threads: each reads state its
owner updates, never calls out (a probe must answer at once, whatever is down).

Liveness (``/healthz``) asks nothing: a process whose HTTP thread answers is alive. A
process kept from being ready by something outside it (a controller away) must not be
restarted for it, which is what failing liveness would make an orchestrator do.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["Check", "Health"]

Check = Callable[[], str | None]
"""None when the check holds, else why not."""


class Health:
    """The readiness checks of one process, in the order added; thread-safe."""

    def __init__(self) -> None:
        self._checks: dict[str, Check] = {}
        self._lock = threading.Lock()

    def add(self, name: str, check: Check) -> None:
        """Add (or replace) the check ``name``."""
        with self._lock:
            self._checks[name] = check

    def results(self) -> list[tuple[str, str | None]]:
        """Each check's name and its reason for failing (None: it holds)."""
        with self._lock:
            checks = list(self._checks.items())
        results: list[tuple[str, str | None]] = []
        for name, check in checks:
            try:
                reason = check()
            except Exception as exc:  # a check that fails to run is a failing check
                reason = f"the check failed: {exc}"
            results.append((name, reason))
        return results

    def ready(self) -> bool:
        return all(reason is None for _, reason in self.results())

    def report(self) -> tuple[bool, str]:
        """Whether every check holds, and one line per check (``ok NAME`` or ``not ready
        NAME: REASON``) for the response body and for people."""
        results = self.results()
        lines = [
            f"ok {name}" if reason is None else f"not ready {name}: {reason}"
            for name, reason in results
        ]
        return all(reason is None for _, reason in results), "\n".join(lines) + "\n"
