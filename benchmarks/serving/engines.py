"""``vllm serve`` processes: started with the bench's options, waited for, stopped.

Each engine runs in a process group of its own (vLLM's API server, engine core and worker
processes), so stopping it stops all three. An engine that exits before it is healthy is a
:class:`EngineFailed` whose reason is the root error in its log, so the bench can say in
one line why a configuration does not run here (e.g. vLLM's CPU offloading on a CPU host).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["EngineFailed", "EngineOptions", "VllmServer"]

LAUNCHER = Path(__file__).with_name("vllm_serve.py")
# A traceback's last line, bare or behind vLLM's log prefix ("(Worker pid=1) ERROR date time
# [file:line] "); warnings that merely mention an error do not match.
_ERROR = re.compile(
    r"^(?:\(\S+ pid=\d+\) ERROR \S+ \S+ \[[^\]]+\] )?(\w*(?:Error|Exception)): (.+)"
)
_GENERIC = ("Engine core initialization failed", "Worker failed", "Application startup failed")


class EngineFailed(RuntimeError):
    """The engine exited, or did not become healthy in time."""


@dataclass(frozen=True)
class EngineOptions:
    """What every engine of a run gets (a configuration adds its own on top)."""

    model: str
    dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    kv_cache_bytes: int | None
    enforce_eager: bool
    extra: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def args(self, port: int) -> list[str]:
        args = [
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            "bench",
            "--skip-tokenizer-init",
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
            "--block-size",
            str(self.block_size),
            # Block hashes every instance computes alike: what lets two engines share.
            "--prefix-caching-hash-algo",
            "sha256_cbor",
            "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log",
            "--seed",
            "0",
        ]
        if self.kv_cache_bytes:
            args += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        if self.enforce_eager:
            args.append("--enforce-eager")
        return args + list(self.extra)


def _get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return 0


class VllmServer:
    """One ``vllm serve`` process group on 127.0.0.1:``port``; its output goes to ``log``."""

    def __init__(
        self,
        name: str,
        options: EngineOptions,
        config_args: list[str],
        *,
        port: int,
        log: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.log = log
        self.args = [*options.args(port), *config_args]
        self._log = log.open("ab")
        self._log.write(f"$ vllm serve {' '.join(self.args)}\n".encode())
        self._log.flush()
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, str(LAUNCHER), "serve", *self.args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **options.env, **(env or {})},
            start_new_session=True,
        )
        self.ready_seconds: float | None = None

    def wait_ready(self, timeout: float) -> float:
        """Seconds from start until ``/health`` answers 200; :class:`EngineFailed` if the
        engine exits first or takes longer than ``timeout``."""
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._close_log()
                raise EngineFailed(self.failure_reason())
            if _get(f"{self.base}/health") == 200:
                self.ready_seconds = time.monotonic() - self.started
                return self.ready_seconds
            time.sleep(1.0)
        self.stop()
        raise EngineFailed(f"not healthy after {timeout:.0f} s (log: {self.log})")

    def failure_reason(self) -> str:
        """The root error in the log: the first specific ``...Error: ...`` line."""
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return f"exited with status {self.process.returncode}"
        errors = [m for line in lines if (m := _ERROR.match(line))]
        specific = [m for m in errors if not any(g in m[2] for g in _GENERIC)]
        found = (specific or errors)[:1]
        where = f" (log: {self.log})"
        if not found:
            return f"exited with status {self.process.returncode}{where}"
        return f"{found[0][1]}: {found[0][2].strip()[:240]}{where}"

    def error_after(self, marker: str) -> str | None:
        """The first error at or after the first log line containing ``marker`` (None when
        ``marker`` is not in the log): for a component that fails inside a running engine."""
        lines = self.log.read_text(errors="replace").splitlines()
        start = next((i for i, line in enumerate(lines) if marker in line), None)
        if start is None:
            return None
        for line in lines[start:]:
            if match := _ERROR.search(line):
                return f"{match[1]}: {match[2].strip()[:240]}"
        return lines[start].strip()[:240]

    def post(self, path: str) -> int:
        request = urllib.request.Request(f"{self.base}{path}", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM to the API server, which shuts its engine core and workers down (the
        connector flushes its saves); SIGKILL to the whole group after ``timeout``."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        # The engine core and workers leave after the API server; give them a while.
        deadline = time.monotonic() + timeout
        while self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        if self._group_alive():
            os.killpg(self.process.pid, signal.SIGKILL)
        self._close_log()

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.process.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def _close_log(self) -> None:
        if not self._log.closed:
            self._log.close()
