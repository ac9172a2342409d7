"""How a job ended, process by process, and which one failed first.

When one rank of a synchronous job fails, the others fail a moment later, with errors that only
say they lost their peer ("Connection closed by peer", a timeout) or with the SIGTERM torchrun
sends them: the report is about the first real failure. Each process tells how it ended in its
events file's end record; one killed by SIGKILL writes none, but its step tally says how far it
got; one killed by a fatal signal leaves faulthandler's traceback (crash-<pid>.txt).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from gpulab.monitor.alive.hang import process_name
from gpulab.monitor.analyze.findings import finding
from gpulab.monitor.events import Recording, trainers

# What a process says when it failed because another one did: gloo's and torch's words for a
# peer that went away or never answered, and gpulab train's own failure protocol.
_LOST_PEER = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|Timed out waiting|timed out|Timeout|"
    r"DistNetworkError|DistStoreError|PeerLost|JobFailed|stopped answering", re.IGNORECASE)
_CRASH_LINE = re.compile(r'File "([^"]+)", line (\d+)')
_KILLED = 128 + 9  # a shell's exit status for SIGKILL, as gpulab reports a job's


@dataclass
class Ending:
    """How one process ended. `how`: "ok", "exception", "signal" (a catchable one: SIGTERM,
    SIGHUP), "crash" (a fatal signal: faulthandler wrote its stack), "exited" (os._exit with a
    code other than 0: no word, but an exit status), "killed" (no word at all: SIGKILL),
    "stopped" (gpulab stopped the job)."""
    who: str
    pid: int | None
    rank: int | None
    how: str
    message: str | None
    where: str | None
    steps: int
    t: float | None  # when it ended (the recording's clock); for "killed", its last sign of life
    lost_peer: bool = False  # its error says it failed because another process did
    stacks: str | None = None  # a crash: faulthandler's Python stack of every thread

    @property
    def failed(self) -> bool:
        return self.how not in ("ok", "stopped")

    @property
    def first_cause(self) -> bool:
        """A failure of its own, not a consequence of another one's."""
        return self.failed and self.how != "signal" and not self.lost_peer


def ending(rec: Recording, stopped_by_gpulab: bool, exit_code: int | None = None) -> Ending:
    """`exit_code`: the process's exit status where gpulab knows it (the script's own process)."""

    def ended(how: str, t: float | None, message: str | None = None, where: str | None = None, **more) -> Ending:
        who = process_name(rec.rank, rec.pid)
        return Ending(who, rec.pid, rec.rank, how, message, where, rec.steps_done, t, **more)

    if rec.end is not None:
        error, t = rec.end.get("error"), rec.end["t"]
        if not error:
            return ended("ok", t)
        if error.startswith("stopped by SIG"):
            return ended("stopped" if stopped_by_gpulab else "signal", t, error)
        return ended("exception", t, _one_line(error), rec.end.get("where"), lost_peer=bool(_LOST_PEER.search(error)))
    last = last_sign_of_life(rec)
    if rec.crash:
        first_line = rec.crash.splitlines()[0].strip()  # 'Fatal Python error: Segmentation fault'
        return ended("crash", last, first_line, _crash_where(rec.crash), stacks=rec.crash)
    if stopped_by_gpulab:
        return ended("stopped", last, "stopped by gpulab (SIGKILL)")
    if exit_code is not None and exit_code != _KILLED:  # it ended itself, past Python's own exit
        if exit_code == 0:
            return ended("ok", last)
        return ended("exited", last, f"exited with {exit_code} through os._exit (no Python clean-up, no traceback)")
    return ended("killed", last, "ended without a word: killed by a signal Python cannot catch (SIGKILL)")


def last_sign_of_life(rec: Recording) -> float | None:
    """The latest moment the process is known to have run: its last step's end (from the durable
    tally, which outlives SIGKILL), else the last record it wrote."""
    times = [rec.tally[1]] if rec.tally and rec.tally[0] > 0 else []
    times += [s["t1"] for s in rec.steps[-1:]] + ([rec.tail["t1"]] if rec.tail else [])
    times += [rec.start.get("t") or 0.0]
    return max(times)


def job_failure(lanes: list[Recording], stopped_by_gpulab: bool, main_pid: int | None = None,
                exit_code: int | None = None) -> dict | None:
    """The job's first failure and how every other process ended; None when no process failed,
    or when the job exited 0: then whatever a child did (a Pool's workers are ended by SIGTERM,
    a child's error may be handled), the script carried on. The processes that trained count: a
    launcher's failure (torchrun's ChildFailedError) and a DataLoader worker's follow from theirs;
    where none trained, the script's own process.
    `exit_code`: the job's, which is its main process's (`main_pid`)."""
    if exit_code == 0:
        return None
    # A job where nothing trained failed before its first step: its own process is what failed.
    judged = trainers(lanes) or [r for r in lanes if r.pid == main_pid and r.recorded]
    endings = [ending(r, stopped_by_gpulab, exit_code if r.pid == main_pid else None) for r in judged]
    failed = [e for e in endings if e.failed]
    if not failed:
        return None
    causes = [e for e in failed if e.first_cause] or failed
    first = min(causes, key=lambda e: (e.t is None, e.t or 0.0))
    others = [e for e in endings if e is not first]
    return {"first": asdict(first), "others": [asdict(e) for e in others]}


_FIXES = {
    "exception": "fix the error {who} raised (its traceback is in the job's output above); the errors of the "
                 "other processes follow from it",
    "crash": "a crash in native code (an extension, a driver, a C++ check that aborted): run {who}'s step alone "
             "with the same input and `python -X faulthandler`, and look at the library the stack ends in",
    "killed": "SIGKILL comes from outside Python: the kernel's out-of-memory killer (`dmesg | grep -i oom`, or "
              "the job's memory limit: a smaller batch, fewer DataLoader workers), a scheduler's limit, or "
              "`kill -9`; torchrun's summary above gives the exit code",
    "exited": "{who} ended itself with os._exit (or a C library's exit()), which skips Python's clean-up and "
              "prints no traceback: find where it is called, and the error it was reporting",
    "signal": "something outside the job sent it that signal (a scheduler's time limit, `kill`): see who, or "
              "give the job more time",
}


def failure_finding(failure: dict) -> dict:
    first = failure["first"]
    who = first["who"] + (f" (pid {first['pid']})" if first["rank"] is not None else "")  # else it is "pid N"
    evidence = f"{who} failed first, after {first['steps']} steps: {first['message']}"
    if first["where"]:
        evidence += f" (at {first['where']})"
    then = [f"{e['who']} after {e['steps']} steps: {e['message'] or 'ended normally'}" for e in failure["others"]]
    if then:
        evidence += "; then " + "; ".join(then)
    fix = _FIXES[first["how"]].format(who=first["who"])
    if "DataLoader worker" in (first["message"] or ""):
        fix = _WORKER_DIED + fix
    f = finding("failure", 1.0, evidence, first["where"], fix=fix, share_of="the run (it ended it)")
    if first["rank"] is not None:
        f["rank"] = first["rank"]
    return f


_WORKER_DIED = (
    "a DataLoader worker died (its own traceback is in the output above): with multiprocessing_context='spawn' "
    "or 'forkserver' - the default on macOS and Windows - each worker imports the script, so its training must "
    "sit under `if __name__ == '__main__':`; "
)

_MESSAGE_CHARS = 240


def _one_line(error: str) -> str:
    """An error message as one line, cut to a length a report line can carry."""
    line = error.strip().splitlines()[0] if error.strip() else error
    return line if len(line) <= _MESSAGE_CHARS else line[:_MESSAGE_CHARS - 3] + "..."


def _crash_where(text: str) -> str | None:
    """The innermost frame of the user's that faulthandler printed for the crashing thread (its
    block starts "Current thread 0x...", innermost frame first; every thread has a block): not an
    installed package's, not the standard library's."""
    start = text.find("Current thread")
    crashing = text[start:] if start >= 0 else text
    crashing = re.split(r"\n\s*\n|\nThread 0x", crashing)[0]
    frames = _CRASH_LINE.findall(crashing)
    mine = [f for f in frames if not _LIBRARY.search(f[0])] or frames
    return f"{mine[0][0]}:{mine[0][1]}" if mine else None


_LIBRARY = re.compile(r"[/\\](site|dist)-packages[/\\]|[/\\]lib[/\\]python3[.\d]*[/\\]")
