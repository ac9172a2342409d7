"""One piece of work at a time on a thread of its own while the run goes on: curves.png being
drawn (curves.py), an epoch's checkpoint and metrics being written (loop.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Background:
    """Work started on a thread, and waited for: `wait()` returns what it raised."""

    def __init__(self, name: str):
        self.name = name
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, work: Callable[[], None]) -> None:
        """Run `work()` on the thread; the work before it must have been waited for."""
        assert self._thread is None, "wait() for the work under way first"

        def run() -> None:
            try:
                work()
            except BaseException as e:  # handed to the caller's thread by wait()
                self._failure = e

        # Not a daemon: an exit waits for the work rather than leave a half-written temporary file.
        self._thread = threading.Thread(target=run, name=self.name)
        self._thread.start()

    def wait(self) -> BaseException | None:
        """The work finished (at once if none is under way); what it raised, if anything."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        failure, self._failure = self._failure, None
        return failure
