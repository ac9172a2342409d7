"""Where the time goes, by line: a thread that samples the training thread's Python stack.

Every `interval_s` it notes the innermost user line the training thread is on, counted under the
category being charged at that moment, so each category gets its hottest lines.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter, defaultdict
from collections.abc import Callable

from gpulab.monitor.record.frames import user_site
from gpulab.monitor.record.interpreter import block_signals_in_this_thread


class StackSampler:
    """`ident()`: the recorded thread (None: none); `category()`: the category charged now (None:
    nothing charged yet, or the span stack changed while it was read)."""

    def __init__(self, interval_s: float, ident: Callable[[], int | None], category: Callable[[], str | None]):
        self.interval_s = interval_s
        self._ident = ident
        self._category = category
        self._hot: dict[str, Counter] = defaultdict(Counter)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpulab-stacks", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)  # never hang an exiting process on the profiler

    def _run(self) -> None:
        block_signals_in_this_thread()
        while not self._stop.wait(self.interval_s):
            ident = self._ident()
            frame = sys._current_frames().get(ident) if ident is not None else None
            category = self._category() if frame is not None else None
            if category is None:
                continue
            where = user_site(frame)
            del frame
            if where is not None:
                with self._lock:
                    self._hot[category][where] += 1

    def snapshot(self) -> dict:
        with self._lock:
            hot = {c: dict(counter.most_common(20)) for c, counter in self._hot.items()}
        return {"type": "hot", "interval_s": self.interval_s, "lines": hot}
