"""Inside each Python process of a profiled job: record it from its own `import torch` to its exit.

autostart/sitecustomize.py calls `install()` at start-up; the script then runs exactly as
`python script.py` would. gpulab waits for torch because importing it first would change the
script (OMP_NUM_THREADS and friends are read when torch loads, and scripts set them before their
`import torch`), and a process that never imports torch (torchrun's agent, the Pythons inductor
starts while it compiles) then costs nothing more than this module, which imports only `os` and
interpreter.py at its top: the recording's own modules load with torch (lifetime.py).
"""

from __future__ import annotations

import os

from gpulab.monitor.record.interpreter import after_import

_PARENT_POLL_S = 0.5
_REMOVE_TRIES = 10  # the recordings' folder, while the job's other processes may still write to it
_recorders: list = []  # this process's recorder, once torch is imported (the parent watch silences it)


def recorder_of_gpulab_profile():
    """The recorder `gpulab profile` started in this process (at its `import torch`), or None."""
    return _recorders[0] if _recorders else None


def install(directory: str) -> None:
    if str(os.getppid()) == os.environ.get("GPULAB_PROFILE_PARENT"):
        _stop_the_job_if_gpulab_dies(directory)
    after_import("torch", lambda torch: _start_recording(directory))


def _start_recording(directory: str) -> None:
    from gpulab.monitor.record.lifetime import start_recording

    _recorders.append(start_recording(directory))


def _stop_the_job_if_gpulab_dies(directory: str) -> None:
    """The script's main process: if `gpulab profile` is killed outright (SIGKILL, OOM killer),
    stop the whole job rather than leave it running, holding a GPU, with nobody to report to,
    and remove the recordings nobody will read."""
    # Here, not at the top: only the script's main process watches.
    import signal
    import threading
    import time

    from gpulab.signals import block_signals_in_this_thread

    parent = os.getppid()

    def watch():
        block_signals_in_this_thread()
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        import shutil
        from contextlib import suppress

        import psutil

        # The recordings go first: a child that ends may end this process at once (a DataLoader's
        # SIGCHLD handler raises in the training thread when a worker is killed). A child still
        # writing may put a file in the folder while it goes; once it is gone, nothing makes it again.
        for recorder in _recorders:
            recorder.writer.silence()
        for _ in range(_REMOVE_TRIES):
            shutil.rmtree(directory, ignore_errors=True)
            if not os.path.exists(directory):
                break
        children = psutil.Process().children(recursive=True)
        for child in children:
            with suppress(psutil.NoSuchProcess):  # it ended meanwhile
                child.terminate()
        _, alive = psutil.wait_procs(children, timeout=5)
        for child in alive:
            with suppress(psutil.NoSuchProcess):
                child.kill()
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="gpulab-parent-watch", daemon=True).start()
