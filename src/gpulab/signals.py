"""Signals and threads. The kernel hands a signal sent to the process to any thread that does not
block it, and Python runs the handler only in the main thread, when that thread next runs Python:
a helper thread that takes SIGTERM leaves a main thread blocked in a lock or a join waiting for
ever. So the threads gpulab starts, and those torch starts at gpulab's call, block the signals a
script handles. Standard library only: the recorder's start-up (record/attach.py) imports it.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager


def _script_signals() -> set[signal.Signals]:
    return {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
            signal.SIGALRM, signal.SIGCHLD}


def block_signals_in_this_thread() -> None:
    """Leave the script's signals to its main thread (called first in each helper thread)."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, _script_signals())


@contextmanager
def threads_started_inside_block_signals() -> Iterator[None]:
    """Around a call that may start threads of its own (torch's profiler starts kineto's
    configuration thread): a thread inherits the mask of the thread that starts it, so the
    script's signals are blocked here meanwhile, and the mask is restored after."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, _script_signals())
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
