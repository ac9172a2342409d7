"""The parent's side of the protocol (protocol.py): once a second, is any process of the job
still making progress?

When none has for `hang_after_s`, the watch asks every process where it is blocked. A hang is a
job with a rank inside a collective: the watch says so on stderr at once and hands it to the
runner, which stops the job or leaves it (--on-hang). With no rank in a collective (one process
saving a large checkpoint, say) it looks again after another `hang_after_s`. It starts once a
process has finished a step: before that there is no step time to judge by.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil

from gpulab.monitor.alive.hang import describe, mismatch, who
from gpulab.monitor.alive.protocol import HANG_PREFIX, HANG_REQUEST, STATUS_PREFIX, read_all
from gpulab.monitor.config import ProfileConfig

MIN_HANG_S = 60.0
STEPS_OF_SILENCE = 100
# A shorter silence is a stall (a rank stops for seconds inside a step, then goes on): the watch
# asks once where everyone is, and keeps the answers for the report (stall.py).
MIN_STALL_S = 5.0
STEPS_OF_STALL = 20
MAX_STALLS = 20  # kept for the report; a job that stalls more often says so with the first ones
ANSWER_S = 3.0
_POLL_S = 1.0


class HangWatch:
    def __init__(self, folder: Path, cfg: ProfileConfig):
        self.folder = folder
        self.cfg = cfg
        self.hang: dict | None = None
        self.stalls: list[dict] = []  # silences that ended: where each process was during them
        self._stall: dict | None = None  # the silence going on, with the answers asked for it
        self._next_poll = 0.0
        self._next_hang_check = 0.0  # a silence with no rank in a collective: look again later
        self._requests = 0
        self._resumed_unix = 0.0  # the job went on after a stop at the terminal: no silence before it

    def poll(self) -> dict | None:
        """The hang, the first time it is found (then None: it is said once)."""
        now = time.monotonic()
        if self.hang is not None or now < self._next_poll:
            return None
        self._next_poll = now + _POLL_S
        statuses = read_all(self.folder, STATUS_PREFIX)
        if not any(s.get("steps", 0) > 0 for s in statuses):
            return None
        # asked where they are: the processes that trained, and every rank (one stopped before its
        # first step was written is the one that matters)
        trained = [s for s in statuses if s.get("steps", 0) > 0 or s.get("rank") is not None]
        slowest = max((s.get("median_step_s") or 0.0) for s in trained)
        hang_after = self.cfg.hang_after_s or max(MIN_HANG_S, STEPS_OF_SILENCE * slowest)
        stall_after = min(hang_after, max(MIN_STALL_S, STEPS_OF_STALL * slowest))
        latest = max(statuses, key=lambda s: s["progress_unix"])
        if self._stall is not None and latest["progress_unix"] > self._stall["since_unix"]:
            self._end_stall(latest)
        idle = time.time() - max(latest["progress_unix"], self._resumed_unix)
        if idle < stall_after:
            return None
        if self._stall is None:
            ranks, unanswered = self._ask(trained)
            self._stall = {"since_unix": latest["progress_unix"], "since_t": latest.get("progress_t"),
                           "ranks": ranks, "unanswered": unanswered}
        if idle < hang_after or now < self._next_hang_check:
            return None
        ranks, unanswered = self._ask(trained)
        if not any(r.get("collective") for r in ranks):
            self._next_hang_check = now + hang_after
            return None
        self._stall = None  # not a stall: it never ended
        self.hang = {"after_s": hang_after, "idle_s": idle, "ranks": ranks, "unanswered": unanswered,
                     "action": self.cfg.on_hang, "mismatch": mismatch(ranks, unanswered)}
        lines = self.hang["lines"] = describe(self.hang)
        then = ("stopping the job (--on-hang wait leaves it running)" if self.cfg.on_hang == "stop"
                else "leaving it running (--on-hang wait); stop it with Ctrl-C")
        print(f"gpulab profile: the job hangs - {lines[0]}:", *(f"  {line}" for line in lines[1:]),
              f"  {then}", sep="\n", file=sys.stderr, flush=True)
        return self.hang

    def resumed(self) -> None:
        """The job goes on after the user stopped it (Ctrl-Z, then fg or bg): the time it was
        stopped is no silence of its own."""
        self._resumed_unix = time.time()

    def finish(self) -> None:
        """The job ended: a silence still open ended with it (the job may go on and end between
        two polls)."""
        if self._stall is not None and self.hang is None:
            statuses = read_all(self.folder, STATUS_PREFIX)
            self._end_stall(max(statuses, key=lambda s: s["progress_unix"]) if statuses else {})

    def _end_stall(self, latest: dict) -> None:
        """Progress again: the silence was a stall. Its length comes from the steps (the report)."""
        stall, self._stall = self._stall, None
        stall["until_t"] = latest.get("progress_t")
        if len(self.stalls) < MAX_STALLS:
            self.stalls.append(stall)

    def _ask(self, trained: list[dict]) -> tuple[list[dict], list[str]]:
        """Every trained process's answer (where it is blocked), and who did not answer in time."""
        self._requests += 1
        asked = str(self._requests)
        (self.folder / HANG_REQUEST).write_text(asked)
        wanted = {s["pid"]: s for s in trained}
        deadline = time.monotonic() + ANSWER_S
        answers: dict[int, dict] = {}
        while len(answers) < len(wanted) and time.monotonic() < deadline:
            time.sleep(0.1)
            answers = {a["pid"]: a for a in read_all(self.folder, HANG_PREFIX)
                       if a.get("pid") in wanted and a.get("request") == asked}
        ranks = sorted(answers.values(), key=lambda a: (a.get("rank") is None, a.get("rank") or 0, a["pid"]))
        return ranks, [_unanswered(who(s), pid) for pid, s in wanted.items() if pid not in answers]


def _unanswered(name: str, pid: int) -> str:
    """A process that did not answer, and why, where the process table says: stopped (SIGSTOP,
    Ctrl-Z, a debugger), gone, or a zombie."""
    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        status = "gone"
    except psutil.Error:
        status = None
    state = _STATE_WORDS.get(status, "did not answer (its Python is blocked too: a C call holding the GIL)")
    return f"{name} (pid {pid}) {state.format(pid=pid)}"


_STATE_WORDS = {
    psutil.STATUS_STOPPED: "is stopped (SIGSTOP, Ctrl-Z or a debugger): `kill -CONT {pid}` lets it go on",
    psutil.STATUS_TRACING_STOP: "is stopped by a debugger (ptrace)",
    psutil.STATUS_ZOMBIE: "has exited (a zombie its parent has not collected)",
    "gone": "has exited",
}

