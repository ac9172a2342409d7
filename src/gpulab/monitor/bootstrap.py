"""The child side of `gpulab profile`: run the user's script under the recorder.

    python -m gpulab.monitor.bootstrap --events FILE --config JSON -- script.py [args...]
                                                                   -- -m module [args...]
                                                                   -- -c code [args...]

The script runs as `__main__` exactly as `python script.py` would run it (its own sys.argv,
sys.path[0] = its folder), like `python -m cProfile script.py`. It keeps its exit code and its
stdout/stderr; an uncaught exception prints the usual traceback (without this module's frames),
after the recorder has written what it saw.
"""

from __future__ import annotations

import importlib.util
import json
import os
import runpy
import sys
import types

from gpulab.monitor.config import ProfileConfig

# This module and runpy (a frozen module since Python 3.11): frames the user did not write.
_OWN_FILES = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}


def main(argv: list[str]) -> None:
    if len(argv) < 6 or argv[0] != "--events" or argv[2] != "--config" or argv[4] != "--":
        sys.exit("usage: python -m gpulab.monitor.bootstrap --events FILE --config JSON -- script.py [args...]")
    events, cfg, target = argv[1], ProfileConfig(**json.loads(argv[3])), argv[5:]
    session = RecordOnceTorchLoads(cfg, events, target)
    try:
        run(target)
    except SystemExit as e:
        session.stop(exit_code=exit_status(e.code))
        raise
    except KeyboardInterrupt:
        session.stop(exit_code=130, error="KeyboardInterrupt")
        raise
    except BaseException as e:
        session.stop(exit_code=1, error=f"{type(e).__name__}: {e}")
        trimmed = _without_own_frames(e.__traceback__)
        sys.excepthook(type(e), e.with_traceback(trimmed), trimmed)
        sys.exit(1)
    session.stop(exit_code=0)


class RecordOnceTorchLoads:
    """Start the recorder right after the script's own `import torch` finishes, not before.

    Importing torch first would change the script: OMP_NUM_THREADS, MKL_NUM_THREADS and friends
    are read when torch loads, and scripts set them before their `import torch`. A finder at the
    head of sys.meta_path waits for the import of "torch" and starts the recorder once the module
    has executed; a script that never imports torch is never touched.
    """

    def __init__(self, cfg: ProfileConfig, events: str, command: list[str]):
        self.cfg, self.events, self.command = cfg, events, command
        self.recorder = None
        if "torch" in sys.modules:
            self._start()
        else:
            sys.meta_path.insert(0, self)

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)  # the real one, from the finders after us
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            self._start()

        spec.loader.exec_module = exec_module
        return spec

    def _start(self) -> None:
        from gpulab.monitor.recorder import Recorder

        self.recorder = Recorder(self.cfg, events_path=self.events).start(command=self.command)

    def stop(self, exit_code: int, error: str | None = None) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        if self.recorder is not None:
            self.recorder.stop(exit_code=exit_code, error=error)


def run(target: list[str]) -> None:
    if target[0] == "-m":
        sys.argv = [target[1], *target[2:]]  # run_module puts the module's file in argv[0]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    elif target[0] == "-c":
        sys.argv = ["-c", *target[2:]]
        sys.path[0] = ""
        main_module = types.ModuleType("__main__")
        sys.modules["__main__"] = main_module
        exec(compile(target[1], "<string>", "exec"), main_module.__dict__)
    else:
        script = target[0]
        sys.argv = list(target)
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


def exit_status(code) -> int:
    """The process exit status Python gives `sys.exit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1  # a message: Python prints it and exits with 1


def _without_own_frames(tb):
    while tb is not None and _own(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def _own(filename: str) -> bool:
    return filename in _OWN_FILES or os.path.abspath(filename) in _OWN_FILES


if __name__ == "__main__":
    main(sys.argv[1:])
