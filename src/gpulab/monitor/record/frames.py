"""The line of the *user's* code responsible for something that happens deep inside torch: the
innermost frame that is not the standard library, an installed package, code torch.compile
generated, or this profiler. gpulab's own trainer counts as user code (`gpulab train --profile`
points at the trainer's lines).
"""

from __future__ import annotations

import getpass
import os
import re
import sysconfig
import tempfile
from pathlib import Path
from types import FrameType

# the profiler's lines, not the user's: gpulab/monitor, gpulab/memory (the memory window measures
# from inside the step), gpulab/compiler.py (torch.compile's callbacks)
_MONITOR_DIR = str(Path(__file__).resolve().parent.parent)
_MEMORY_DIR = str(Path(__file__).resolve().parent.parent.parent / "memory")
_COMPILER_FILE = str(Path(__file__).resolve().parent.parent.parent / "compiler.py")


def generated_code_dirs() -> set[str]:
    """Where torch.compile writes the code it generates and runs (inductor's cache: TORCHINDUCTOR_
    CACHE_DIR, else torch's default, `<tmp>/torchinductor_<user>`; Triton's): never a user's line."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
    triton = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton")
    return {inductor, triton}


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.update((_MONITOR_DIR, _MEMORY_DIR))
    roots.update(generated_code_dirs())
    try:
        import torch

        roots.add(str(Path(torch.__file__).resolve().parent))
    except ImportError:
        pass
    return (*(os.path.realpath(r) + os.sep for r in roots), os.path.realpath(_COMPILER_FILE))


_ROOTS: tuple[str, ...] | None = None
_IS_USER: dict[str, bool] = {}


def is_user_file(filename: str) -> bool:
    """True for the user's source files ("<string>" from `python -c` included)."""
    global _ROOTS
    known = _IS_USER.get(filename)
    if known is None:
        _ROOTS = _ROOTS or _library_roots()
        # not <frozen ...>, <stdin>, generated code
        known = _IS_USER[filename] = filename == "<string>" or (
            not filename.startswith("<") and not os.path.realpath(filename).startswith(_ROOTS))
    return known


def format_site(filename: str, lineno: int) -> str:
    """`path:line`, the path relative to the working directory when it lies below it."""
    if not filename.startswith("<"):
        try:
            rel = os.path.relpath(filename)
            if not rel.startswith(".."):
                filename = rel
        except ValueError:  # another drive on Windows
            pass
    return f"{filename}:{lineno}"


def user_site(frame: FrameType | None) -> str | None:
    """The innermost user frame at or above `frame`, as `path:line`; None when there is none."""
    while frame is not None:
        code = frame.f_code
        if is_user_file(code.co_filename):
            return format_site(code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return None
