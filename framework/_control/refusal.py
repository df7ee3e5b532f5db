"""A request the controller refuses (an ERROR reply of its code), and what a handler is."""

from __future__ import annotations

from collections.abc import Callable

from kvfabric._runtime.codec import Reader
from kvfabric._wire.protocol import ErrorCode

__all__ = ["Handler", "Refusal"]

Handler = Callable[[Reader], Callable[[], bytes]]
"""Decodes a request's body and returns what applying it does, so that the frame is checked
whole (no trailing bytes) before anything changes."""


class Refusal(Exception):
    """Raised by a handler; the reply carries ``code`` (nothing reads the text)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
