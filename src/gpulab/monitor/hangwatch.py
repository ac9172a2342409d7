"""The parent's hang watch: once a second, is any process of the job still making progress?

Each recorded process keeps `status-<pid>.json` (record/heartbeat.py): its steps and when it last
finished a step, a collective or an outermost module call. When none has for `hang_after_s`
(default max(60 s, 100 x the slowest median step)), the watch asks every process where it is
blocked (`hang-request`) and waits up to ANSWER_S for the answers. A hang is a job with a rank
inside a collective: then the watch says so on stderr at once and hands the hang to the runner,
which stops the job or leaves it (--on-hang). Otherwise (no rank in a collective: one process
saving a large checkpoint, say) it is no hang of the job's communication, and the watch looks
again after another `hang_after_s`. The watch starts once a process has finished a step: before
that there is no step time to judge by (a slow start is not a hang).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from gpulab.monitor.analyze.hang import describe, mismatch, who
from gpulab.monitor.config import ProfileConfig
from gpulab.monitor.events import HANG_PREFIX, HANG_REQUEST, STATUS_PREFIX

MIN_HANG_S = 60.0
STEPS_OF_SILENCE = 100
ANSWER_S = 3.0
_POLL_S = 1.0


class HangWatch:
    def __init__(self, folder: Path, cfg: ProfileConfig):
        self.folder = folder
        self.cfg = cfg
        self.hang: dict | None = None
        self._next_poll = 0.0
        self._requests = 0

    def poll(self) -> dict | None:
        """The hang, the first time it is found (then None: it is said once)."""
        now = time.monotonic()
        if self.hang is not None or now < self._next_poll:
            return None
        self._next_poll = now + _POLL_S
        statuses = _read_all(self.folder, STATUS_PREFIX)
        trained = [s for s in statuses if s.get("steps", 0) > 0]
        if not trained:
            return None
        after = self.cfg.hang_after_s or max(MIN_HANG_S, STEPS_OF_SILENCE * max(
            (s.get("median_step_s") or 0.0) for s in trained))
        idle = time.time() - max(s["progress_unix"] for s in statuses)
        if idle < after:
            return None
        ranks, unanswered = self._ask(trained)
        if not any(r.get("collective") for r in ranks):
            self._next_poll = now + after
            return None
        self.hang = {"after_s": after, "idle_s": idle, "ranks": ranks, "unanswered": unanswered,
                     "mismatch": mismatch(ranks, unanswered), "action": self.cfg.on_hang}
        self.hang["lines"] = describe(self.hang)
        self._say(self.hang)
        return self.hang

    def _ask(self, trained: list[dict]) -> tuple[list[dict], list[str]]:
        """Every trained process's answer: where it is blocked; and who did not answer in time."""
        self._requests += 1
        asked = str(self._requests)
        (self.folder / HANG_REQUEST).write_text(asked)
        wanted = {s["pid"]: s for s in trained}
        deadline = time.monotonic() + ANSWER_S
        answers: dict[int, dict] = {}
        while len(answers) < len(wanted) and time.monotonic() < deadline:
            time.sleep(0.1)
            answers = {a["pid"]: a for a in _read_all(self.folder, HANG_PREFIX)
                       if a.get("pid") in wanted and a.get("request") == asked}
        ranks = sorted(answers.values(), key=lambda a: (a.get("rank") is None, a.get("rank") or 0, a["pid"]))
        unanswered = [who(s) for pid, s in wanted.items() if pid not in answers]
        return ranks, unanswered

    @staticmethod
    def _say(hang: dict) -> None:
        then = ("stopping the job (--on-hang wait leaves it running)" if hang["action"] == "stop"
                else "leaving it running (--on-hang wait); stop it with Ctrl-C")
        lines = hang["lines"]
        print(f"gpulab profile: the job hangs - {lines[0]}:", *(f"  {line}" for line in lines[1:]),
              f"  {then}", sep="\n", file=sys.stderr, flush=True)


def _read_all(folder: Path, prefix: str) -> list[dict]:
    found = []
    for path in folder.glob(f"{prefix}*.json"):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # being replaced, or gone
            pass
    return found
