"""Logging what an unauthenticated peer can trigger: its text truncated and escaped, its
warnings rate-limited, so a stranger can neither forge log lines nor flood the log."""
from __future__ import annotations

import logging
import threading
import time


def quote(text: object, limit: int = 80) -> str:
    """`text` (a peer's string) cut to `limit` characters and escaped like `repr`: one line,
    no control or non-printable characters."""
    s = text if isinstance(text, str) else str(text)
    cut = s[:limit]
    return repr(cut) + ("..." if len(s) > limit else "")


class WarnLimiter:
    """At most `burst` warnings per `period_s`; the rest are counted, and the next warning
    allowed says how many were suppressed."""

    def __init__(self, logger: logging.Logger, period_s: float = 10.0, burst: int = 5):
        self._logger, self._period_s, self._burst = logger, period_s, burst
        self._lock = threading.Lock()
        self._window_start = -period_s
        self._num_in_window = 0
        self.num_suppressed = 0  # since the last warning that went out

    def warning(self, fmt: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._window_start >= self._period_s:
                self._window_start, self._num_in_window = now, 0
            if self._num_in_window >= self._burst:
                self.num_suppressed += 1
                return
            self._num_in_window += 1
            suppressed, self.num_suppressed = self.num_suppressed, 0
        if suppressed:
            fmt += " (%d similar warnings suppressed)"
            args = (*args, suppressed)
        self._logger.warning(fmt, *args)
