"""When one rank of a torchrun job fails: how the others learn it, which rank it was, and how
each of them stops with one line.

- A collective that fails because of another rank (it died, hung past --timeout, or its link
  went down) raises PeerLost on the survivors: `is_communication_error` tells such a failure
  from the other errors a step can raise.
- torchrun sends SIGTERM to the other ranks when one fails (a job scheduler may send it too):
  it becomes the exception Terminated, so that they can say why they stop.
- A rank that fails on its own leaves its reason in the job's store (`report`).
- A survivor raises a flag in the store and every live rank checks in, answered by a small
  watchdog thread so that a rank blocked inside a collective still counts as alive; whoever does
  not check in is the rank that failed, and the message names it (`failure`: a JobFailed). The
  watchdog also says where its rank's main thread is: a rank alive but stuck outside torch and
  gpulab (a hang in its own code) is the one a timed-out collective waited for.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from datetime import timedelta

from gpulab.errors import Terminated
from gpulab.host import PR_SET_PDEATHSIG, prctl
from gpulab.parallel.launch import exit_summary

CHECK_IN_S = 2.0  # how long survivors of a failure wait for each other in the store
WATCHDOG_POLL_S = 0.5  # how often each rank's watchdog looks for a failure flag


class PeerLost(RuntimeError):
    """A collective failed because another rank died, hung past the timeout or crashed."""


class JobFailed(Exception):
    """This rank stopped because of another rank's failure; the message says which and where."""

    def __init__(self, message: str, quiet: bool):
        super().__init__(message)
        self.quiet = quiet  # another surviving rank prints the same line


def is_communication_error(e: BaseException) -> bool:
    """Whether a collective failed because of another rank, not because of this rank's step."""
    import torch.distributed as dist

    # torch's own failures are DistErrors: the store's (DistStoreError, DistNetworkError) and
    # NCCL's (c10::DistBackendError). gloo's are not. Measured with torch 2.13 (CPU), 2 gloo ranks,
    # in all_reduce (also async, at wait()), barrier, broadcast_object_list and gather_object: a
    # peer killed before or during the collective gives a plain RuntimeError "[.../third_party/
    # gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:PORT. ...", a hung
    # one "[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv
    # operation to complete". gloo names its source file in every error it raises.
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and "gloo" in str(e))


def main_thread_outside() -> str | None:
    """Where the main thread is ("at train.py:41 in forward"), when its innermost Python frame is
    neither torch's nor gpulab's - its own code, the standard library - else None: inside a
    collective, a step, anything a timeout elsewhere may be waiting on."""
    import torch

    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return None
    path = os.path.abspath(frame.f_code.co_filename)
    ours = (os.path.dirname(os.path.abspath(torch.__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if any(path.startswith(root + os.sep) for root in ours):
        return None
    return f"at {os.path.basename(path)}:{frame.f_lineno} in {frame.f_code.co_name}"


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".strip()


class FailureProtocol:
    """One rank's part in the protocol above, over the job's store (its keys under `prefix`).

    Made once the rank has joined the store: from then on SIGTERM raises Terminated (when made on
    the main thread, the only one that may handle signals) and the watchdog answers check-ins,
    until `close()`."""

    def __init__(self, store, prefix: str, rank: int, world_size: int):
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.world_size = world_size
        self.step_timeout_s: float | None = None
        """--timeout, once the training group has it: named when a collective timed out."""
        self.stopping = False  # True once a failure is being reported or the World closes: SIGTERM waits
        self.terminated = False  # SIGTERM came (its exception may have been dropped: raise_if_terminated)
        self.previous_sigterm = None
        self.previous_unraisablehook = None
        if threading.current_thread() is threading.main_thread():
            self.previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
            # Its agent (torchrun, in-process in gpulab launch) killed outright would leave this rank
            # training on unsupervised: its death is a SIGTERM here, as torchrun's own stop is.
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            self.previous_unraisablehook, sys.unraisablehook = sys.unraisablehook, self._on_unraisable
        self.stop_watchdog = threading.Event()
        self.watchdog = threading.Thread(target=self._watchdog, name="gpulab-watchdog", daemon=True)
        self.watchdog.start()

    def close(self) -> None:
        self.stopping = True  # a SIGTERM now must not replace the exception this rank is reporting
        self.stop_watchdog.set()
        self.watchdog.join(timeout=10)  # its store calls time out after 5 s
        if self.previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self.previous_sigterm)
            self.previous_sigterm = None
        if self.previous_unraisablehook is not None:
            sys.unraisablehook, self.previous_unraisablehook = self.previous_unraisablehook, None

    def _on_sigterm(self, signum, frame) -> None:
        if not self.stopping:  # while a failure is being reported, or at close, finish that first
            self.terminated = True
            raise Terminated()

    def raise_if_terminated(self) -> None:
        """Raise Terminated again if SIGTERM came and this rank is still at work. Python runs a
        signal handler wherever the main thread is, also inside a weakref callback or __del__,
        which the garbage collector starts at any allocation: there the exception is dropped (to
        sys.unraisablehook) and the rank would go on (seen: the garbage collector emptying
        matplotlib's text cache during the step after rank 0 drew curves.png)."""
        if self.terminated and not self.stopping:
            raise Terminated()

    def _on_unraisable(self, unraisable) -> None:
        """A Terminated dropped as above is raised again by the next collective: no traceback."""
        if not issubclass(unraisable.exc_type, Terminated):
            self.previous_unraisablehook(unraisable)

    def report(self, error: BaseException) -> None:
        """This rank is failing on its own: leave the reason where the survivors will look."""
        self.stopping = True
        try:
            self.store.set_timeout(timedelta(seconds=5))
            self.store.set(self.prefix + f"failed/{self.rank}", one_line(error))
        except Exception:
            pass  # the store may be gone with rank 0; the launcher's summary still has it

    def failure(self, error: BaseException, where: str, hint: str) -> JobFailed:
        """The one-line message for a rank that stops because another failed."""
        self.stopping = True
        alive, reasons, outside = self._check_in()
        # Failed: ranks that left a reason, and ranks that did not answer the check-in.
        failed = sorted(set(reasons) | ({r for r in range(self.world_size) if r not in alive} if alive else set()))
        alive = [r for r in alive if r not in reasons]
        stuck = {r: where for r, where in outside.items() if r in alive}
        if failed:
            named = "; ".join(
                f"rank {r} failed: {reasons[r]}" if r in reasons else f"rank {r} stopped answering"
                for r in failed
            )
            cause = f"{named} ({exit_summary()} shows how it exited)"
        elif stuck and isinstance(error, PeerLost):  # the collective waited for a rank busy elsewhere
            cause = "; ".join(f"rank {r} never reached the collective: it is stuck {where}, outside torch and gpulab"
                              for r, where in sorted(stuck.items())) + f" (the collective failed: {one_line(error)})"
        elif isinstance(error, Terminated):
            cause = "stopped by SIGTERM (from the launcher, after another rank failed, or from a job scheduler)"
        else:
            cause = f"a collective failed: {error}"
        if isinstance(error, PeerLost) and "Timed out" in str(error) and self.step_timeout_s is not None:
            cause += f"; the step timeout is --timeout {self.step_timeout_s:g} s"
        quiet = bool(alive) and self.rank != min(alive)  # the lowest surviving rank speaks for all
        return JobFailed(f"{where}: {cause}. {hint}", quiet=quiet)

    def _watchdog(self) -> None:
        """Check this rank in when another raises the failure flag, even while the main thread
        is blocked in a collective or a store call. A dead or stopped process cannot: that is
        how it is found. Its own store client with a short timeout: it never waits behind the
        main thread's client, and never blocks the process from exiting for long."""
        import torch.distributed as dist

        try:
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                timeout=timedelta(seconds=5), wait_for_workers=False,
            )
        except Exception:
            return  # no second connection: the check-in then sees this rank only if it answers itself
        flag = self.prefix + "failure"
        while not self.stop_watchdog.wait(WATCHDOG_POLL_S):
            try:
                if store.check([flag]):
                    store.set(self.prefix + f"alive/{self.rank}", (main_thread_outside() or "").encode())
                    return
            except Exception:
                return  # the store is gone: nobody is left to ask

    def _check_in(self) -> tuple[list[int], dict[int, str], dict[int, str]]:
        """Raise the failure flag, then see which ranks answer within CHECK_IN_S: (the ranks alive,
        each failed rank's reason, where each other rank's main thread is stuck outside torch and
        gpulab, as its watchdog said)."""
        import torch.distributed as dist

        try:
            self.store.set_timeout(timedelta(seconds=5))
            self.store.set(self.prefix + "failure", b"1")
            self.store.set(self.prefix + f"alive/{self.rank}", b"1")
            keys = [self.prefix + f"alive/{r}" for r in range(self.world_size)]
            try:
                self.store.wait(keys, timedelta(seconds=CHECK_IN_S))  # returns as soon as all are in
            except dist.DistStoreError:
                pass  # someone is missing: find out who below
            alive = [r for r in range(self.world_size) if self.store.check([keys[r]])]
            outside = {r: where for r in alive if (where := self.store.get(keys[r]).decode(errors="replace"))
                       and r != self.rank and where != "1"}
            reasons = {}
            for r in range(self.world_size):
                if self.store.check([self.prefix + f"failed/{r}"]):
                    reasons[r] = self.store.get(self.prefix + f"failed/{r}").decode()
            return alive, reasons, outside
        except Exception:
            return [], {}, {}  # the store went down with the rank that hosted it
