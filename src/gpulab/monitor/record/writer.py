"""Records out: kept in memory (the in-process API) or appended to this process's events file.

To a file, a helper thread writes the new records every FLUSH_EVERY_S, so a recording survives
its process however it ends: a rank blocked inside a collective (its main thread never back in
Python) is written in full, one killed by SIGKILL loses at most its last quarter second. The
whole-run tallies (snapshots) are appended every SNAPSHOT_EVERY_S and at the end (the reader
keeps the last of each kind). Steps after the detailed window go out summed in blocks (blocks.py).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from gpulab.monitor.record.blocks import StepBlocks
from gpulab.signals import block_signals_in_this_thread

FLUSH_EVERY_S = 0.25
SNAPSHOT_EVERY_S = 2.0  # snapshots are whole tallies, rewritten each time: not every flush


class EventWriter:
    """`path` None: every record stays in memory (the snapshots are added at the final flush)."""

    def __init__(self, path: Path | None, snapshots: Callable[[], list[dict]], detail_steps: int):
        self.path = Path(path) if path else None
        self._detail_steps = detail_steps
        # appended by the training thread, drained by the flushing one (deque: both are atomic)
        self._pending: deque[dict] = deque()
        self._snapshots = snapshots
        self.on_tick: Callable[[], None] | None = None  # more work for the helper thread (alive/child.py)
        self.silenced = False  # a DataLoader worker: writes nothing
        self._start_lane()

    @property
    def records(self) -> list[dict]:
        """Everything recorded so far (in memory), or what is not written yet (to a file)."""
        return list(self._pending)

    def emit(self, record: dict) -> None:
        if self.path is None:  # in memory: nothing drains it, so the steps are summed here
            self._pending.extend(self._blocks.out(record))
        else:
            self._pending.append(record)

    def new_lane(self, path: Path) -> None:
        """In a forked child: its own file, from scratch (the parent's thread and lock stay behind)."""
        self.path = Path(path)
        self._pending = deque()
        self._start_lane()

    def _start_lane(self) -> None:
        self._pid = os.getpid()
        self._blocks = StepBlocks(self._detail_steps)
        self._lock = threading.RLock()  # the flushing thread and the final flush (a signal handler)
        # A tick apart: the final flush need not wait for one (it may read a hung collective's state).
        self._ticking = threading.Lock()
        self._closed = False
        self._last_snapshot = 0.0
        if self.path is not None:
            threading.Thread(target=self._flush_periodically, name="gpulab-flush", daemon=True).start()

    def _flush_periodically(self) -> None:
        block_signals_in_this_thread()
        pid = self._pid
        while not (self._closed or self.silenced) and os.getpid() == pid:
            time.sleep(FLUSH_EVERY_S)
            now = time.monotonic()
            with self._ticking:  # silence() waits for a tick under way: nothing is written after it returns
                if self.on_tick is not None and not self.silenced:
                    self.on_tick()
            try:
                self._write(with_snapshots=now - self._last_snapshot >= SNAPSHOT_EVERY_S)
            except RuntimeError:  # a tally changed size while read from this thread: next time
                pass

    def close(self) -> None:
        """Write what is pending, with the whole-run tallies, and end the lane."""
        if self.path is None:
            self._pending.extend(self._blocks.close() + self._snapshots())
            return
        self._write(with_snapshots=True, final=True)

    def silence(self) -> None:
        """Write nothing from now on, no tick either; a write or tick under way finishes first."""
        with self._lock, self._ticking:
            self.silenced = True

    def _write(self, with_snapshots: bool, final: bool = False) -> None:
        with self._lock:
            if self._closed or self.silenced or os.getpid() != self._pid:
                return
            # the tallies first, written out at once: read from this thread they may raise (a
            # dict changing size), and nothing pending is taken before that
            snapshots = [json.dumps(r) for r in self._snapshots()] if with_snapshots else []
            lines = []
            while self._pending:
                lines.extend(json.dumps(r) for r in self._blocks.out(self._pending.popleft()))
            if final:
                lines.extend(json.dumps(r) for r in self._blocks.close())
            lines.extend(snapshots)
            if with_snapshots:
                self._last_snapshot = time.monotonic()
            if final:
                self._closed = True
            if lines:
                with open(self.path, "a") as f:
                    f.write("\n".join(lines) + "\n")
