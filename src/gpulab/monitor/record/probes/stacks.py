"""The stack probe: where the time goes, by line - samples of the training thread's Python stack,
each weighing the wall time it stands for, tallied under the category charged at that moment:
the hottest user lines of each category, with the steps each line was sampled in (a cost paid
every step belongs at a line that runs in many of them). A step's samples are held until it
ends, and dropped if it was an outlier (OUTLIER_FACTOR times the recent median: an evaluation,
a checkpoint). How, and why (docs/profiling.md):

- By signal, while SIGALRM is free: a wall-clock timer (ITIMER_REAL) raises it every
  `interval_s`, and Python runs the handler in the main thread between two bytecodes, on the
  frame it interrupted - wall time, so a sleep is seen. Inside a long C call no handler runs:
  each sample weighs the time since the one before. Interrupted system calls are restarted.
- By thread otherwise (the recorded thread is not the main thread, the script has a SIGALRM
  handler or alarm, or takes SIGALRM while recording: hand_signal_back_on_request; or calls
  signal.pause(), which the sampler's signal would end): sys._current_frames(), whose samples
  land where the training thread lets the GIL go.

Each sample also says how much of its time the thread was blocked (schedstat), so a line where
the loop waits is told from one where it computes. The tally has one writer at a time (the
handler, or the sampling thread) and is copied by the event writer's thread: each dict copy is
atomic under the GIL, so no lock is taken - a handler waiting for a lock the main thread holds
would never return.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

from gpulab.host import schedstat
from gpulab.monitor.config import OUTLIER_FACTOR
from gpulab.monitor.record.frames import user_site
from gpulab.signals import block_signals_in_this_thread
from gpulab.monitor.record.probe import Probe

# A thread running pure Python hands the GIL over only every sys.getswitchinterval() (5 ms by
# default), so the thread sampler's samples would land on the next torch call rather than inside
# the Python that holds the GIL; 1 ms keeps that bias under its 20 ms period.
_THREAD_SWITCH_INTERVAL_S = 0.001
_TOP_LINES = 20  # per category, in the snapshot
_RECENT_STEPS = 31  # the median an outlier step is judged by: of this many steps before it

# The unpatched calls: while recording, the script's calls go through hand_signal_back_on_request.
_set_handler, _get_handler = signal.signal, signal.getsignal
_set_timer = getattr(signal, "setitimer", None)
_get_timer = getattr(signal, "getitimer", None)
_SIGALRM = getattr(signal, "SIGALRM", None)  # neither exists on Windows: the thread it is
_ITIMER_REAL = getattr(signal, "ITIMER_REAL", None)


class StackProbe(Probe):
    """`interval_s`: the sampling period; 0: no sampling (the snapshot says so)."""

    def __init__(self, interval_s: float):
        self._interval_s = interval_s
        self._sampler: StackSampler | None = None

    def hook(self) -> None:
        if self._interval_s > 0:
            # the script taking SIGALRM later stops the signal sampler first (then a forked lane's)
            hand_signal_back_on_request(self.patches.patch, lambda: self._sampler)
            self._start_sampler()
            self.listen(self.sink.notices.step_ended, self._step_ended)

    def _step_ended(self, steps_done: int) -> None:
        now = time.perf_counter()
        if self._sampler is not None:
            self._sampler.step_ended(now - self._step_ended_at)
        self._step_ended_at = now

    def _start_sampler(self) -> None:
        self._sampler = StackSampler(self._interval_s, lambda: self.sink.ident, self.sink.steps.charged_category,
                                     self.sink.own_work_seconds)
        self._sampler.start()
        self._step_ended_at = time.perf_counter()

    def after_fork(self) -> None:
        if self._sampler is not None:
            self._sampler.forget_in_child()  # the parent's sampler: its timer or thread stayed there

    def new_lane(self) -> None:
        if self._interval_s > 0:
            self._start_sampler()

    def finish(self) -> None:
        if self._sampler is not None:
            self._sampler.stop()

    def snapshots(self) -> list[dict]:
        if self._sampler is None:
            return [{"type": "hot", "interval_s": self._interval_s, "lines": {}, "steps": {}}]
        return [self._sampler.snapshot()]


class StackSampler:
    """`ident()`: the recorded thread (None: none); `category()`: the category charged now (None:
    none yet); `own_work()`: the sink's own_work_seconds. `method`: "signal" or "thread" once started."""

    def __init__(self, interval_s: float, ident: Callable[[], int | None], category: Callable[[], str | None],
                 own_work: Callable[[], tuple[float, bool]] = lambda: (0.0, False)):
        self.interval_s = interval_s
        self._ident = ident
        self._category = category
        self._own_work = own_work  # never the script's time
        self._own_at_last_sample = 0.0
        self._seconds: dict[str, dict[str, float]] = {}  # category -> user line -> seconds
        self._blocked: dict[str, dict[str, float]] = {}  # category -> user line -> seconds of them blocked
        self._activity = Activity()
        self._steps: dict[str, dict[str, int]] = {}  # category -> user line -> steps sampled in
        # this step's samples, until it ends: (category, user line) -> [seconds, seconds blocked]
        self._held: dict[tuple[str, str], list[float]] = {}
        self._recent: deque[float] = deque(maxlen=_RECENT_STEPS)  # the latest steps' seconds
        self.method: str | None = None
        self._last_sample = 0.0
        self._thread: threading.Thread | None = None
        self._stop_thread = threading.Event()
        self._previous_switch_interval: float | None = None

    def start(self) -> None:
        if _signal_is_free_for(self._ident()):
            self._start_signal()
        else:
            self._start_thread()

    def stop(self) -> None:
        """Disarm the timer or end the thread, the default handler back; the run's tail counts."""
        if self.method == "signal":
            _set_timer(_ITIMER_REAL, 0)
        elif self.method == "thread":
            self._stop_thread.set()
            if self._thread is not None:
                self._thread.join(timeout=1.0)  # never hang an exiting process on the profiler
        self.forget_in_child()
        self._tally_held()

    def forget_in_child(self) -> None:
        """Give back the SIGALRM handler and the switch interval: all that comes along into a forked
        child (neither the timer nor the thread does)."""
        if self.method == "thread":
            self._restore_switch_interval()
        self._give_handler_back()
        self.method = None

    def hand_back_signal(self) -> None:
        """The script is about to take SIGALRM or the real-time timer: stop ours, give the signal
        back, and go on sampling by thread."""
        if self.method != "signal":
            return
        self.method = "handing back"
        _set_timer(_ITIMER_REAL, 0)
        self._give_handler_back()
        self._start_thread()

    def snapshot(self) -> dict:
        copied = {c: dict(lines) for c, lines in list(self._seconds.items())}  # atomic copies (module doc)
        hot = {c: {where: round(s, 4) for where, s in sorted(lines.items(), key=lambda x: -x[1])[:_TOP_LINES]}
               for c, lines in copied.items()}
        steps = {c: {where: self._steps[c][where] for where in lines} for c, lines in hot.items()}
        blocked = {c: {where: round(self._blocked[c].get(where, 0.0), 4) for where in lines} for c, lines in hot.items()}
        return {"type": "hot", "interval_s": self.interval_s, "method": self.method, "lines": hot, "steps": steps,
                "blocked": blocked}

    def _note(self, frame, seconds: float, blocked: float) -> None:
        """One sample: `frame` stood for `seconds` of the category charged now, `blocked` of them blocked."""
        category = self._category()
        if category is None:
            return
        where = user_site(frame)
        if where is None:
            return
        held = self._held.setdefault((category, where), [0.0, 0.0])
        held[0] += seconds
        held[1] += blocked

    def step_ended(self, seconds: float) -> None:
        """The step of `seconds` ended: its samples count, unless it was an outlier."""
        recent = self._recent
        outlier = len(recent) >= 3 and seconds > OUTLIER_FACTOR * statistics.median(recent) if self._held else False
        recent.append(seconds)
        self._tally_held(keep=not outlier)

    def _tally_held(self, keep: bool = True) -> None:
        # The dict is replaced before it is read: a sample landing meanwhile (the signal handler
        # between two bytecodes, or the sampling thread) goes into the new one, never into the one
        # being read.
        held = self._held
        self._held = {}
        if not keep:
            return
        for (category, where), (seconds, blocked) in list(held.items()):
            lines = self._seconds.get(category)
            if lines is None:
                lines = self._seconds[category] = {}
                self._steps[category] = {}
                self._blocked[category] = {}
            # the step count first: a snapshot that sees the line finds its count
            self._steps[category][where] = self._steps[category].get(where, 0) + 1
            lines[where] = lines.get(where, 0.0) + seconds
            if blocked:
                self._blocked[category][where] = self._blocked[category].get(where, 0.0) + blocked

    # ------------------------------------------------------------------ by signal

    def _start_signal(self) -> None:
        _set_handler(_SIGALRM, self._on_signal)  # in place of SIG_DFL (_signal_is_free_for)
        signal.siginterrupt(_SIGALRM, False)  # restart interrupted system calls (SA_RESTART)
        self.method = "signal"
        self._last_sample, self._own_at_last_sample = time.perf_counter(), self._own_work()[0]
        _set_timer(_ITIMER_REAL, self.interval_s, self.interval_s)

    def _give_handler_back(self) -> None:
        """Restore SIGALRM's default, if our handler is still set (only the main thread may: from
        another, our handler passes the next signal on and restores it then)."""
        if (_SIGALRM is not None and threading.current_thread() is threading.main_thread()
                and _get_handler(_SIGALRM) == self._on_signal):
            _set_handler(_SIGALRM, signal.SIG_DFL)

    def _on_signal(self, signum, frame) -> None:
        if self.method != "signal":  # handed back from another thread: the signal is the script's
            self._pass_on(signum, frame)
            return
        now = time.perf_counter()
        own, under_way = self._own_work()
        # the time since the last sample, less gpulab's own work in it (a window's measurement between
        # two steps, whose frames sit below the script's line that ended the step): not the script's
        seconds = (now - self._last_sample) - (own - self._own_at_last_sample)
        self._last_sample, self._own_at_last_sample = now, own
        blocked = self._activity.blocked_share(threading.get_native_id(), now)
        if not under_way:
            self._note(frame, seconds, seconds * blocked)

    @staticmethod
    def _pass_on(signum, frame) -> None:
        """Our handler got a signal that is the script's (an alarm it set without a handler, or
        our handler put back from an earlier getsignal): restore the default and let it act."""
        _set_handler(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

    # ------------------------------------------------------------------ by thread

    def _start_thread(self) -> None:
        self._previous_switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._previous_switch_interval, _THREAD_SWITCH_INTERVAL_S))
        self.method = "thread"
        self._stop_thread.clear()
        self._thread = threading.Thread(target=self._run_thread, name="gpulab-stacks", daemon=True)
        self._thread.start()

    def _restore_switch_interval(self) -> None:
        if self._previous_switch_interval is not None:
            sys.setswitchinterval(self._previous_switch_interval)
            self._previous_switch_interval = None

    def _run_thread(self) -> None:
        block_signals_in_this_thread()
        while not self._stop_thread.wait(self.interval_s):
            ident = self._ident()
            frame = sys._current_frames().get(ident) if ident is not None else None
            if frame is not None:
                blocked = self._activity.blocked_share(_native_id(ident), time.perf_counter())
                if not self._own_work()[1]:
                    # one period each: weighing by the time since the last sample would add to the
                    # bias (a long wait for the GIL ends where the training thread lets it go); none
                    # while gpulab's own work runs
                    self._note(frame, self.interval_s, self.interval_s * blocked)
            del frame


class Activity:
    """The share of the time since the last call that a thread was blocked: neither on a core nor
    waiting on a run queue for one (/proc's schedstat). 0 when not known: the first call for a
    thread, a kernel without schedstat, a thread gone."""

    def __init__(self):
        self._last: tuple[int, int, float] | None = None  # (thread id, ns ran or queued, perf_counter)

    def blocked_share(self, tid: int | None, now: float) -> float:
        times = schedstat(os.getpid(), tid) if tid is not None else None
        last, self._last = self._last, (tid, sum(times), now) if times is not None else None
        if times is None or last is None or last[0] != tid or now <= last[2]:
            return 0.0
        active_s = (sum(times) - last[1]) / 1e9
        return min(max(1.0 - active_s / (now - last[2]), 0.0), 1.0)


def _native_id(ident: int) -> int | None:
    """The kernel's id of the live thread whose threading ident is `ident`."""
    return next((t.native_id for t in threading.enumerate() if t.ident == ident), None)


def _signal_is_free_for(ident: int | None) -> bool:
    """Can the recorded thread be sampled by SIGALRM? Only the main thread runs handlers (and
    only it may set them: we are in it), and the signal must be unused: no handler of the
    script's, no alarm set."""
    return (_set_timer is not None and ident is not None and ident == threading.get_ident()
            and threading.current_thread() is threading.main_thread()
            and _get_handler(_SIGALRM) == signal.SIG_DFL and _get_timer(_ITIMER_REAL) == (0.0, 0.0))


def hand_signal_back_on_request(patch, sampler: Callable[[], StackSampler | None]) -> None:
    """Patch (through `patch(owner, name, make_wrapper)`) the calls by which a script takes
    SIGALRM - signal.signal(SIGALRM, ...), signal.alarm, signal.setitimer(ITIMER_REAL, ...) - and
    signal.pause(), which any handled signal ends, so that `sampler()` hands the signal back first
    (no hook exists for them)."""
    if _set_timer is None:
        return

    def handing_back(concerns_sigalrm):
        def make_wrapper(original):
            def wrapper(*args, **kwargs):
                current = sampler()
                if current is not None and concerns_sigalrm(*args, **kwargs):
                    current.hand_back_signal()
                return original(*args, **kwargs)

            return wrapper

        return make_wrapper

    patch(signal, "signal", handing_back(lambda signalnum, *args, **kwargs: signalnum == _SIGALRM))
    patch(signal, "alarm", handing_back(lambda *args, **kwargs: True))
    patch(signal, "setitimer", handing_back(lambda which, *args, **kwargs: which == _ITIMER_REAL))
    patch(signal, "pause", handing_back(lambda: True))
