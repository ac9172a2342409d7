"""Records out: kept in memory (the in-process API) or appended to this process's events file.

The file is written about once a second and at the end, so a process that crashes still leaves
most of its record; the whole-run tallies (snapshots) are appended at every flush, and the
reader keeps the last one of each kind.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

_FLUSH_EVERY_S = 1.0


class EventWriter:
    """`path` None: every record stays in `records` (the snapshots are added at the final flush)."""

    def __init__(self, path: Path | None, snapshots: Callable[[], list[dict]]):
        self.path = Path(path) if path else None
        self.records: list[dict] = []  # all records (in memory), or those not yet written (to a file)
        self._snapshots = snapshots
        self._pid = os.getpid()
        self._last_flush = time.perf_counter()
        self.silenced = False  # a DataLoader worker: writes nothing

    def emit(self, record: dict) -> None:
        self.records.append(record)

    def new_lane(self, path: Path) -> None:
        """In a forked child: its own file, from scratch."""
        self.path = Path(path)
        self.records = []
        self._pid = os.getpid()
        self._last_flush = time.perf_counter()

    def flush_if_due(self, now: float) -> None:
        if now - self._last_flush > _FLUSH_EVERY_S:
            self.flush()

    def flush(self, final: bool = False) -> None:
        """Append pending records to the events file, then the whole-run tallies."""
        self._last_flush = time.perf_counter()
        if self.path is None:
            if final:
                self.records.extend(self._snapshots())
            return
        if os.getpid() != self._pid or self.silenced:
            return
        lines = [json.dumps(r) for r in [*self.records, *self._snapshots()]]
        with open(self.path, "a") as f:
            f.write("\n".join(lines) + "\n")
        self.records.clear()
