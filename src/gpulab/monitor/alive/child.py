"""The child's side of the protocol (protocol.py), inside each recorded process.

The training thread notes its progress: each step, finished collective and outermost module call
(an evaluation loop makes progress too), each a few attribute writes. The step tally is a file
mapped into memory, in the kernel's page cache at once, so a process killed by SIGKILL still tells
its exact steps (the events file may lack its last quarter second). The writer's helper thread
calls Heartbeat.tick() every quarter second to write the status and answer the parent's requests:
it can say where the training thread is blocked because a thread blocked in a collective has
released the GIL.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from statistics import median

import torch

from gpulab.monitor.alive.protocol import HANG_REQUEST, TALLY, answer_file, status_file, tally_file, write_json
from gpulab.monitor.record.frames import format_site, is_user_file

_STACK_DEPTH = 12  # user frames kept, innermost first


class Progress:
    """Written by the training thread only, read by the helper thread. `folder`: where the durable
    step tally goes (None: in-process sessions keep none)."""

    def __init__(self, folder: Path | None = None, pid: int | None = None):
        self.steps = 0
        self.last_t = time.perf_counter()  # the last progress, on the recording's clock
        self._unix_offset = time.time() - self.last_t  # fixed once: a derived time must not jitter
        self._step_durations: deque[float] = deque(maxlen=101)
        self._last_step_t: float | None = None
        self._tally = _map_tally(tally_file(folder, pid or os.getpid())) if folder is not None else None

    def step_done(self, steps: int) -> None:
        now = time.perf_counter()
        if self._last_step_t is not None:
            self._step_durations.append(now - self._last_step_t)
        self._last_step_t = self.last_t = now
        self.steps = steps
        if self._tally is not None:
            TALLY.pack_into(self._tally, 0, steps, now)

    def made(self) -> None:
        """A collective or an outermost module call finished (one clock read: it runs per call)."""
        self.last_t = time.perf_counter()

    @property
    def last_unix(self) -> float:
        """The last progress as wall-clock time, by which the parent compares processes."""
        return self.last_t + self._unix_offset

    def median_step_s(self) -> float | None:
        durations = list(self._step_durations)
        return median(durations) if durations else None


class Heartbeat:
    def __init__(self, folder: Path, pid: int, rank: int | None, training_thread: Callable[[], int | None],
                 progress: Progress):
        self.folder = folder
        self.pid = pid
        self.rank = rank
        self.progress = progress
        self._training_thread = training_thread
        self._last_status: dict | None = None
        self._answered = ""  # the parent's last request answered (it numbers them)

    def tick(self) -> None:
        """The status, when it changed; where the training thread is blocked, when newly asked."""
        status = {"pid": self.pid, "rank": self.rank, "steps": self.progress.steps,
                  "progress_unix": round(self.progress.last_unix, 3), "progress_t": round(self.progress.last_t, 4),
                  "median_step_s": self.progress.median_step_s()}
        request = self.folder / HANG_REQUEST
        try:  # OSError: the folder is gone (gpulab ended) or the disk is full: the recording goes on
            if status != self._last_status:
                write_json(status_file(self.folder, self.pid), status)
                self._last_status = status
            if request.exists() and (asked := request.read_text()) != self._answered:
                self._answered = asked
                blocked = {"pid": self.pid, "rank": self.rank, "steps": self.progress.steps,
                           "idle_s": round(time.time() - self.progress.last_unix, 1),
                           "collective": _pending_collective(), "stack": self._training_stack()}
                write_json(answer_file(self.folder, self.pid), {**blocked, "request": asked})
        except OSError:
            pass

    def _training_stack(self) -> list[str]:
        """The training thread's user frames, innermost first, as `path:line in function`."""
        frame = sys._current_frames().get(self._training_thread())
        stack = []
        while frame is not None and len(stack) < _STACK_DEPTH:
            code = frame.f_code
            if is_user_file(code.co_filename):
                stack.append(f"{format_site(code.co_filename, frame.f_lineno)} in {code.co_name}")
            frame = frame.f_back
        return stack


def _pending_collective() -> dict | None:
    """The oldest collective of this process that has not finished, from torch's flight recorder
    (on when TORCH_FR_BUFFER_SIZE > 0, which gpulab sets); None when there is none or no recorder."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        entries = json.loads(_dump_fr_trace_json(True, True)).get("entries", [])
    except Exception:  # a private API: absent or changed in this torch
        return None
    pending = [e for e in entries if not e.get("retired", True)]
    if not pending:
        return None
    e = min(pending, key=lambda e: e.get("time_created_ns", 0))
    op = str(e.get("profiling_name", "?")).split(":")[-1]
    return {"op": op, "seq": e.get("collective_seq_id"), "group": (e.get("process_group") or ["?", "?"])[1],
            "sizes": e.get("input_sizes"), "dtypes": e.get("input_dtypes"), "state": e.get("state")}


def _map_tally(path: Path) -> mmap.mmap | None:
    """The step tally's file, mapped (None where it cannot be made: the recording goes on)."""
    try:
        with open(path, "w+b") as f:
            f.truncate(TALLY.size)
            return mmap.mmap(f.fileno(), TALLY.size)
    except (OSError, ValueError):
        return None

