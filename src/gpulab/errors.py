"""The one exception type that means "the user asked for something we cannot do", and SIGTERM
as an exception.

The CLI prints a `UserError` as a single line and exits with status 2; anything else is
a bug and keeps its traceback. `Terminated` is one line and 143.
"""

import signal
import threading
from contextlib import contextmanager


class UserError(ValueError):
    """Bad input from the user: the message names the problem and the fix."""


class Terminated(BaseException):
    """SIGTERM (from torchrun after another rank failed, from a scheduler, from `timeout`): stop
    cleanly, every `with` and `finally` on the way out run."""


@contextmanager
def sigterm_raises():
    """Inside the block, SIGTERM raises Terminated in the main thread (where Python runs signal
    handlers) instead of ending the process at once: temporary folders and child processes are
    cleaned up on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
