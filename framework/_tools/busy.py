"""A busy pure-Python thread: an engine's scheduler or event loop, standing in.

Measurements and tests put it beside a read or a put: each time kvfabric takes the GIL back
while it counts, kvfabric waits out about one switch interval (5 ms), so what a batch costs
beside it shows how often the batch needs the GIL. ``count`` says how far it got.

:class:`BusyProcess` runs the same loop in a process of its own: the CPU it takes, without
the GIL. What a batch loses beside it is CPU contention alone (on a machine with fewer idle
cores than the batch, its server and the loop need), so beside the thread against beside
the process is the GIL's own share.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

__all__ = ["BusyProcess", "BusyThread"]


class BusyThread:
    """A counting loop on its own thread, for the span of a ``with`` block."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvfabric-busy", daemon=True)

    def _run(self) -> None:
        while not self._stop:
            self.count += 1

    def __enter__(self) -> BusyThread:
        self._thread.start()
        while self.count == 0:  # running before the caller measures anything
            time.sleep(0.001)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()


class BusyProcess:
    """The same counting loop in a process of its own, for the span of a ``with`` block."""

    def __enter__(self) -> BusyProcess:
        self._child = subprocess.Popen(
            [sys.executable, "-c", "print(flush=True)\nn = 0\nwhile True:\n    n += 1"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._child.stdout is not None
        self._child.stdout.readline()  # running before the caller measures anything
        return self

    def __exit__(self, *exc: object) -> None:
        self._child.kill()
        self._child.wait()
        if self._child.stdout is not None:
            self._child.stdout.close()
