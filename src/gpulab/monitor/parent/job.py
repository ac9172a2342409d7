"""The job's processes, from start to a clean end, whatever the job does.

The job runs in its own process group, and gpulab is its subreaper (Linux): a process whose
parent died (a rank after torchrun was killed, a DataLoader worker after its rank) becomes
gpulab's child instead of init's, so it can still be found and stopped.

The first SIGINT, SIGTERM or SIGHUP sent to gpulab (a terminal, `timeout`, Slurm, Kubernetes) is
passed on to the job's group once, so the script's handlers run, and torchrun's, which passes it
on to the ranks. STOP_GRACE_S later, or at once on a second signal, every process of the job gets
SIGTERM (recorders flush on it), and KILL_GRACE_S after that SIGKILL: a rank blocked inside a
collective never runs a Python signal handler, and torchrun would give it 30 s more. What the
main process leaves running is stopped the same way. If gpulab is killed outright, the job stops
itself (record/attach.py watches its parent).

At a terminal the job is its foreground group, as a shell makes a job, so Ctrl-C and Ctrl-Z reach
it directly; when Ctrl-Z stops it, gpulab stops too, the shell gets the terminal back, and `fg`
resumes both.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import suppress

import psutil

from gpulab.host import PR_SET_CHILD_SUBREAPER, prctl

STOP_GRACE_S = 5.0  # from the first signal to SIGTERM for every process of the job
KILL_GRACE_S = 2.0  # from that SIGTERM to SIGKILL: 7 s in all, inside `timeout -k 10` and Slurm's 30 s
STOP_SEEN_LATE_S = 1.0  # a stop at the terminal is seen within a poll (0.2 s) and the tick's work after it
LEFTOVER_GRACE_S = 2.0  # from SIGTERM to SIGKILL for what the job's main process left behind
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Job:
    """One command run to a clean end; a context manager around start() and wait()."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self._me = psutil.Process()
        self._children_before: set[int] = set()
        self._subreaper = False
        self._previous_handlers: dict = {}
        self._received: list[int] = []
        self._term_at: float | None = None  # SIGTERM for every process of the job, then
        self._kill_at: float | None = None  # SIGKILL
        self._tty: int | None = None
        # (perf_counter, perf_counter) of each time the job was stopped at the terminal and went on;
        # the stop is seen up to a poll after it came, so each starts STOP_SEEN_LATE_S early
        self.suspended: list[tuple[float, float]] = []

    def __enter__(self) -> "Job":
        self._children_before = {p.pid for p in self._me.children()}
        self._subreaper = prctl(PR_SET_CHILD_SUBREAPER, 1)  # False where unsupported
        for signum in _FORWARDED:
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.proc is not None:
                self.stop_leftovers()
        finally:
            if self._tty is not None:
                _give_terminal_to(self._tty, os.getpgrp())
            for signum, handler in self._previous_handlers.items():
                signal.signal(signum, handler)
            if self._subreaper:
                prctl(PR_SET_CHILD_SUBREAPER, 0)

    def start(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        self.proc = subprocess.Popen(argv, env=env, process_group=0)
        return self.proc

    def wait(self, on_tick: Callable[[], None] = lambda: None, on_resume: Callable[[], None] = lambda: None) -> int:
        """The job's exit status, shell-style (128 + N for signal N); `on_tick` runs about every
        0.2 s meanwhile, `on_resume` when the job goes on after a stop at the terminal."""
        self._tty = _take_terminal_for(self.proc.pid)
        for signum in self._received:  # arrived before the job existed
            self._pass_on(signum)
        while True:
            try:
                code = self.proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if self._tty is not None and _stopped(self.proc.pid):
                    self._stop_with_the_job()
                    on_resume()
                on_tick()
                self._escalate(time.monotonic())
        return 128 - code if code < 0 else code

    def _stop_with_the_job(self) -> None:
        """The job was stopped at the terminal (Ctrl-Z): stop gpulab too, so the shell takes the
        terminal back - else it waits on gpulab while the terminal stays with the stopped job."""
        seen = time.perf_counter()
        _give_terminal_to(self._tty, os.getpgrp())
        os.kill(os.getpid(), signal.SIGTSTP)  # its default action: gpulab stops here until SIGCONT
        self.suspended.append((seen - STOP_SEEN_LATE_S, time.perf_counter()))
        if _foreground(self._tty):
            _give_terminal_to(self._tty, self.proc.pid)
        self._signal_group(signal.SIGCONT)

    def _on_signal(self, signum, frame) -> None:
        self._received.append(signum)
        if self.proc is None:
            return
        if len(self._received) == 1:
            self._pass_on(signum)
        else:  # the user insists
            self.stop()

    @property
    def stopping(self) -> bool:
        """gpulab is ending the job (a signal to gpulab, or stop()), not the job itself."""
        return self._term_at is not None

    def stop(self) -> None:
        """End the job now: SIGTERM to every process, SIGKILL KILL_GRACE_S later."""
        self._term_at = time.monotonic()

    def _pass_on(self, signum: int) -> None:
        self._signal_group(signum)
        if self._term_at is None:
            self._term_at = time.monotonic() + STOP_GRACE_S

    def _escalate(self, now: float) -> None:
        if self._term_at is not None and now >= self._term_at and self._kill_at is None:
            self.signal_all(signal.SIGTERM)
            self._kill_at = now + KILL_GRACE_S
        if self._kill_at is not None and now >= self._kill_at:
            self.signal_all(signal.SIGKILL)

    def processes(self) -> list[psutil.Process]:
        """Every live process the job started: the main one, its descendants, and the orphans that
        came to gpulab (the children gpulab had before the job are not the job's)."""
        found: dict[int, psutil.Process] = {}
        try:
            tops = [p for p in self._me.children() if p.pid not in self._children_before]
        except psutil.Error:
            return []
        for top in tops:
            found[top.pid] = top
            with suppress(psutil.Error):
                found.update((p.pid, p) for p in top.children(recursive=True))
        return list(found.values())

    def signal_all(self, signum: int) -> None:
        """`signum` to the job's group and to every process of the job, wherever it is."""
        self._signal_group(signum)
        _send(self.processes(), signum)

    def stop_leftovers(self) -> None:
        """After the main process ended: what it left behind gets SIGTERM, then SIGKILL; the
        orphans that came to gpulab are reaped (psutil.wait_procs reaps its own children)."""
        self._signal_group(signal.SIGTERM)
        left = [p for p in self.processes() if p.pid != self.proc.pid]
        _send(left, signal.SIGTERM)
        _, alive = psutil.wait_procs(left, timeout=LEFTOVER_GRACE_S)
        self._signal_group(signal.SIGKILL)
        _send(alive, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=LEFTOVER_GRACE_S)

    def _signal_group(self, signum: int) -> None:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signum)


def _send(processes: list[psutil.Process], signum: int) -> None:
    for p in processes:
        with suppress(psutil.Error):
            p.send_signal(signum)  # psutil checks the pid still names the same process


def _stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def _foreground(fd: int) -> bool:
    """Is gpulab's group the terminal's foreground group?"""
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False


def _take_terminal_for(pgid: int) -> int | None:
    """Make the job the terminal's foreground group, as a shell would, so that Ctrl-C reaches it
    directly and it can read stdin (breakpoint()); the fd to give the terminal back."""
    try:
        fd = sys.stdin.fileno()
        if not os.isatty(fd) or not _foreground(fd):
            return None
        _give_terminal_to(fd, pgid)
        return fd
    except (OSError, ValueError, AttributeError):
        return None


def _give_terminal_to(fd: int, pgid: int) -> None:
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # a background group may not set it
    try:
        with suppress(OSError):
            os.tcsetpgrp(fd, pgid)
    finally:
        signal.signal(signal.SIGTTOU, previous)
