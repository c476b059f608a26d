"""The process-wide settings a router holds while it serves (`CompletionEndpoints.tune_process`):
the cyclic collector's young-generation threshold and the GIL's switch interval, set by the first
router of the process and restored when the last one lets go (tests and benchmarks run several)."""
from __future__ import annotations

import gc
import sys
import threading

# Python's default (700 new container objects per young collection) makes a 29k-message body set off dozens of
# collections, and a full one every ~100 of them: each stops every thread (the loop's too).
GC_GEN0_THRESHOLD = 20_000
GIL_SWITCH_INTERVAL_S = 0.001


class _ProcessTuning:
    """The process-wide settings of `tune_process`, held by every router of the process at once (tests and
    benchmarks run several): set by the first holder, restored when the last one lets go."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._num_holders = 0
        self._saved: tuple[tuple[int, ...], float] | None = None

    def hold(self) -> None:
        with self._lock:
            gc.collect()
            gc.freeze()
            if self._num_holders == 0:
                self._saved = (gc.get_threshold(), sys.getswitchinterval())
                gc.set_threshold(GC_GEN0_THRESHOLD, *self._saved[0][1:])
                sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
            self._num_holders += 1

    def release(self) -> None:
        with self._lock:
            self._num_holders -= 1
            if self._num_holders == 0 and self._saved is not None:
                gc.unfreeze()  # what the routers held can be collected again once they are gone
                thresholds, interval = self._saved
                gc.set_threshold(*thresholds)
                sys.setswitchinterval(interval)
                self._saved = None


PROCESS_TUNING = _ProcessTuning()
