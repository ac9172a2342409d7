"""A bytecode cache of gpulab's own, for installs whose packages cannot be written.

Python keeps each module's compiled bytecode beside its source (`__pycache__/`), written the
first time the module is imported. Where the installed packages are read-only (a container's
image, a shared install) and came without bytecode, nothing is ever written there, and every
process compiles every module it imports from source again: most of torch, each time. gpulab
then points `sys.pycache_prefix` at a folder of its own cache, so that the first run writes the
bytecode there and every later run reads it.

Only there: with a prefix set, Python reads bytecode from the prefix alone, never from the
`__pycache__` folders beside the sources, so an install that has them (or can write them) keeps
them. And only at start-up, before torch is imported: a module already imported was compiled.
The choice travels to the processes gpulab starts (torchrun's ranks, spawned data workers)
through PYTHONPYCACHEPREFIX.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

from gpulab.io import cache_dir

PROBE = "torch"
"""The package whose install decides: the one whose import is most of a process's start-up."""


def use_own_cache_where_needed() -> Path | None:
    """Set Python's bytecode prefix to gpulab's cache when PROBE's install has no bytecode and
    cannot be given any; the prefix, or None where nothing was changed."""
    if sys.pycache_prefix or sys.dont_write_bytecode or PROBE in sys.modules:
        return None  # the user chose, or it is too late to matter
    source = module_source(PROBE)
    if source is None or has_bytecode(source) or os.access(source.parent, os.W_OK):
        return None
    prefix = cache_dir() / "pycache"
    try:
        prefix.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # no cache either: Python compiles from source, as it would have
    if not os.access(prefix, os.W_OK):
        return None
    sys.pycache_prefix = str(prefix)
    os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)
    return prefix


def module_source(name: str) -> Path | None:
    """The source file of top-level package or module `name`, found on sys.path without importing
    it and without asking sys.meta_path's finders (an import hook there, the profiler's, waits
    for the module's import)."""
    try:
        spec = importlib.machinery.PathFinder.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin)


def has_bytecode(source: Path) -> bool:
    """Whether `source` has its bytecode where Python looks for it now (`__pycache__/` beside it)."""
    return Path(importlib.util.cache_from_source(str(source))).is_file()
