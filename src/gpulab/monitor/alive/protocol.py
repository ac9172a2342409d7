"""The files by which the parent (watch.py) asks whether the job is alive and each process
(child.py) answers, beside the events files (monitor/events.py) in the job's recording folder:

    status-<pid>.json   the process's steps, when it last made progress (a step, a collective,
                        an outermost module call), its median step; rewritten every quarter
                        second while it changes
    hang-request        a number: the parent asks every process where it is blocked
    hang-<pid>.json     the answer, carrying that number: the collective the training thread
                        waits in and its user frames
    tally-<pid>.bin     steps done and when the last one ended, in a file mapped into memory: a
                        process killed by SIGKILL still tells how far it got (read with the
                        recording, events.py)

The JSON files are replaced whole: a reader sees the old one or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path

STATUS_PREFIX = "status-"
HANG_REQUEST = "hang-request"
HANG_PREFIX = "hang-"
TALLY = struct.Struct("<qd")  # steps done, when the last one ended (perf_counter)


def status_file(folder: Path, pid: int) -> Path:
    return folder / f"{STATUS_PREFIX}{pid}.json"


def answer_file(folder: Path, pid: int) -> Path:
    return folder / f"{HANG_PREFIX}{pid}.json"


def tally_file(directory: Path | str, pid: int) -> Path:
    return Path(directory) / f"tally-{pid}.bin"


def read_tally(path: Path) -> tuple[int, float] | None:
    try:
        steps, t = TALLY.unpack(Path(path).read_bytes()[:TALLY.size])
    except (OSError, struct.error):
        return None
    return steps, t


def write_json(path: Path, record: dict) -> None:
    """Whole or not at all (written beside, then renamed). Not gpulab.io's atomic_write_json, which
    syncs to disk: a status file is rewritten four times a second and matters only while the job runs."""
    tmp = path.with_name(f".{path.name}.{threading.get_ident()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def read_all(folder: Path, prefix: str) -> list[dict]:
    """Every `<prefix><pid>.json` in `folder` that reads whole (one being replaced, or gone, is skipped)."""
    found = []
    for path in folder.glob(f"{prefix}*.json"):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            pass
    return found
