"""Peak resident memory of this process above a baseline, sampled by a thread (the benchmarks' host figures)."""

from __future__ import annotations

import threading
import time

import psutil


class PeakRSS:
    """start() takes the baseline and starts sampling every `interval_s`; stop() returns the peak above it, bytes."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._proc = psutil.Process()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.base = self.peak = 0

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self.interval_s)

    def start(self) -> PeakRSS:
        self.base = self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak - self.base
