"""Inside each Python process of a profiled job: record it from its own `import torch` to its exit.

autostart/sitecustomize.py calls `install()` at interpreter start-up when `gpulab profile` runs
the job. The script runs exactly as `python script.py` would run it (its own `__main__`,
sys.argv, tracebacks, exit code); gpulab only waits for torch.

Why wait: importing torch first would change the script. OMP_NUM_THREADS, MKL_NUM_THREADS and
friends are read when torch loads, and scripts set them before their `import torch`; a process
that never imports torch (torchrun's agent, a tokenizer worker) costs nothing more.

How a recording ends: at interpreter exit (atexit), at the end of a multiprocessing child (which
leaves with os._exit, skipping atexit: probes/processes.py patches Process._bootstrap), or on
SIGTERM / SIGHUP when the script has no handler of its own (flush, then die of the signal as
before).
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import shutil
import signal
import sys
import threading
import time

from gpulab.host import let_gloo_workers_finish
from gpulab.monitor.config import ProfileConfig
from gpulab.monitor.events import crash_file, events_file
from gpulab.monitor.record.interpreter import after_import, block_signals_in_this_thread

_PARENT_POLL_S = 0.5
_recorders: list = []  # this process's recorder, once torch is imported (the parent watch silences it)


def install(directory: str) -> None:
    cfg = ProfileConfig(**json.loads(os.environ.get("GPULAB_PROFILE_CONFIG") or "{}"))
    if str(os.getppid()) == os.environ.get("GPULAB_PROFILE_PARENT"):
        _stop_the_job_if_gpulab_dies(directory)
    after_import("torch", lambda torch: _start_recording(cfg, directory))


def _start_recording(cfg: ProfileConfig, directory: str) -> None:
    # Here, not at the top: this module loads in every process of the job, the recorder (torch)
    # only in those that import torch.
    from gpulab.monitor.record.recorder import Recorder

    recorder = Recorder(cfg, events_path=events_file(directory, os.getpid()))
    recorder.start(command=list(getattr(sys, "orig_argv", sys.argv)))
    _recorders.append(recorder)
    atexit.register(let_gloo_workers_finish)  # atexit runs the last registered first: this after the stop
    atexit.register(recorder.stop_in_any_process)
    _write_crashes_to(crash_file(directory, os.getpid()))
    _note_uncaught_exceptions(recorder)
    _flush_on_termination(recorder)


def _write_crashes_to(path) -> None:
    """A fatal signal (SIGSEGV in an extension, SIGABRT from a C++ check, SIGBUS) kills the process
    before any Python handler runs: faulthandler writes its Python stack to a file for the report.
    A script that turned faulthandler on itself (-X faulthandler, PYTHONFAULTHANDLER) keeps its own."""
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
    """On SIGTERM/SIGHUP (timeout, Slurm, Kubernetes, gpulab passing one on), write what was
    recorded, then die of the signal as the script would have. A script's own handler wins."""
    if threading.current_thread() is not threading.main_thread():
        return

    sigchld = getattr(signal, "SIGCHLD", None)  # POSIX only

    def flush_and_die(signum, frame):
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


def _stop_the_job_if_gpulab_dies(directory: str) -> None:
    """The script's main process: if `gpulab profile` is killed outright (SIGKILL, OOM killer),
    stop the whole job rather than leave it running, holding a GPU, with nobody to report to,
    and remove the recordings nobody will read."""
    parent = os.getppid()

    def watch():
        block_signals_in_this_thread()
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        import psutil

        children = psutil.Process().children(recursive=True)
        for child in children:
            child.terminate()
        _, alive = psutil.wait_procs(children, timeout=5)
        for child in alive:
            child.kill()
        for recorder in _recorders:  # its writer would put a file back while the folder goes
            recorder.writer.silence()
        shutil.rmtree(directory, ignore_errors=True)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="gpulab-parent-watch", daemon=True).start()
