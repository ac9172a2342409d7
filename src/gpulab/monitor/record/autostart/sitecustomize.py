"""Put every Python process of a profiled job under gpulab's recorder.

`gpulab profile` puts this folder first on the PYTHONPATH of the command it runs, so Python
imports this file at start-up in the script and every Python process it starts. Only standard-
library imports: it runs in processes that never touch torch, and must cost them nothing but
this. Each process writes one line saying it exists (or why gpulab could not load there), then
waits for its own `import torch` (attach.py). Any other sitecustomize on the path runs after it.
"""

import os
import sys


def _note_process(directory: str, error: str | None = None) -> None:
    import time

    record = {"type": "process", "pid": os.getpid(), "ppid": os.getppid(), "t": time.perf_counter(),
              "argv": list(getattr(sys, "orig_argv", sys.argv)), "executable": sys.executable, "error": error}
    with open(os.path.join(directory, f"events-{os.getpid()}.jsonl"), "a") as f:
        f.write(to_json(record) + "\n")


def to_json(value) -> str:
    """What json.dumps writes for the process record's values. Not json itself: it brings `re` and
    `enum` into every Python process of the job, most of which never import torch (an inductor
    compile starts six, and waits for each)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(to_json, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{to_json(str(k))}: {to_json(v)}" for k, v in value.items()) + "}"
    return '"' + "".join(map(_escaped, value)) + '"'


def _escaped(char: str) -> str:
    """A character of a JSON string as json.dumps writes it (ASCII only: the rest as \\uXXXX)."""
    if char in '"\\':
        return "\\" + char
    if " " <= char <= "~":
        return char
    code = ord(char)
    if code > 0xFFFF:  # a surrogate pair
        code -= 0x10000
        return f"\\u{0xD800 | code >> 10:04x}\\u{0xDC00 | code & 0x3FF:04x}"
    return _SHORT.get(char) or f"\\u{code:04x}"


_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}


def _attach(directory: str) -> None:
    try:
        from gpulab.monitor.record import attach
    except Exception as e:  # noqa: BLE001 - any failure to load must not stop the user's script
        _note_process(directory, error=f"{type(e).__name__}: {e}")
        return
    _note_process(directory)
    attach.install(directory)


def _run_next_sitecustomize() -> None:
    import importlib.machinery

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        import importlib.util  # only then: it brings contextlib, functools and more

        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if os.environ.get("GPULAB_PROFILE_DIR"):
    _attach(os.environ["GPULAB_PROFILE_DIR"])
_run_next_sitecustomize()
