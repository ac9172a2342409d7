"""A recording's life in one process of a profiled job, from its `import torch` (attach.py) to
its end: at interpreter exit (atexit), at the end of a multiprocessing child (probes/processes.py),
or on SIGTERM / SIGHUP when the script has no handler of its own; a fatal signal's stack in a file
of its own; an uncaught exception noted.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import signal
import sys
import threading

from gpulab.host import let_gloo_workers_finish
from gpulab.monitor.config import ProfileConfig
from gpulab.monitor.events import crash_file, events_file
from gpulab.monitor.record.recorder import Recorder


def start_recording(directory: str) -> Recorder:
    """This process's recorder, started, writing into `directory`; returned for the parent watch."""
    cfg = ProfileConfig(**json.loads(os.environ.get("GPULAB_PROFILE_CONFIG") or "{}"))
    recorder = Recorder(cfg, events_path=events_file(directory, os.getpid()))
    recorder.start(command=list(getattr(sys, "orig_argv", sys.argv)))
    atexit.register(let_gloo_workers_finish)  # atexit runs the last registered first: this after the stop
    atexit.register(recorder.stop_in_any_process)
    _write_crashes_to(crash_file(directory, os.getpid()))
    _note_uncaught_exceptions(recorder)
    _flush_on_termination(recorder)
    return recorder


def _write_crashes_to(path) -> None:
    """A fatal signal (SIGSEGV in an extension, SIGABRT from a C++ check) kills the process before
    any Python handler runs: faulthandler writes its Python stack to a file for the report. A
    script that turned faulthandler on itself keeps its own."""
    if faulthandler.is_enabled():
        return
    try:
        crashes = open(path, "w")  # kept open: faulthandler writes to its descriptor when it fires
    except OSError:
        return
    faulthandler.enable(file=crashes, all_threads=True)  # what gpulab's own threads were doing too
    _KEPT_OPEN.append(crashes)


_KEPT_OPEN: list = []


def _note_uncaught_exceptions(recorder) -> None:
    previous = sys.excepthook

    def excepthook(kind, value, tb):
        recorder.note_exception(value, tb)
        previous(kind, value, tb)

    sys.excepthook = excepthook


def _flush_on_termination(recorder) -> None:
    """On SIGTERM/SIGHUP (timeout, Slurm, gpulab passing one on), write what was recorded, then die
    of the signal as the script would have. A script's own handler wins, also one that calls this one."""
    if threading.current_thread() is not threading.main_thread():
        return

    sigchld = getattr(signal, "SIGCHLD", None)  # POSIX only

    def flush_and_die(signum, frame):
        if signal.getsignal(signum) is not flush_and_die:
            # A handler the script installed since called this one, the one it replaced (as
            # Lightning's does). Without gpulab it would have found SIG_DFL, which it does not
            # call: the script decides, and its recording is written when it ends.
            return
        # A signal sent to the job's process group also ends its DataLoader workers, and the
        # DataLoader's SIGCHLD handler would raise "worker killed" in the middle of this flush
        # (the recording lost, silently: the process dies of the signal right after). Blocking
        # SIGCHLD is not enough: a worker that died a moment earlier has already tripped it, and
        # Python runs the handler at the flush's first wait. So it runs one that does nothing
        # (SIG_DFL would do too, but Python then prints "Signal 17 ignored due to race condition").
        if sigchld is not None:
            signal.signal(sigchld, _ignore_signal)
        try:
            recorder.stop_in_any_process(exit_code=128 + signum, error=f"stopped by {signal.Signals(signum).name}")
        except Exception as e:  # say so: the process is about to die of the signal, without a traceback
            print(f"gpulab profile: process {os.getpid()} could not write its recording: "
                  f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) == signal.SIG_DFL:
            signal.signal(signum, flush_and_die)


def _ignore_signal(signum, frame) -> None:
    pass
