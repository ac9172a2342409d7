"""What the recorder needs from the interpreter: code run right after a module is imported, and
signals kept away from its helper threads. Standard library only, and `signal` (it brings `enum`)
only where a thread needs it: every Python process of a profiled job imports this at start-up.
"""

from __future__ import annotations

import sys


def after_import(name: str, callback):
    """callback(module) once module `name` has been imported and executed (now, if it already has
    been); returns an undo that drops the hook if it has not fired yet.

    A finder at the head of sys.meta_path finds the real spec with the finders after it and runs
    `callback` right after the module's own code. It leaves sys.meta_path when the module is
    executed, not when it is looked for: importlib.util.find_spec(name) imports nothing."""
    if name in sys.modules:
        callback(sys.modules[name])
        return lambda: None

    class Finder:
        def find_spec(self, fullname, path=None, target=None):
            if fullname != name:
                return None
            later = sys.meta_path[sys.meta_path.index(self) + 1:]
            sys.meta_path.remove(self)  # a finder after it that asks the import system again finds the real spec
            try:  # each asked as the import system asks them (importlib.util would import more)
                specs = (f.find_spec(fullname, path, target) for f in later if hasattr(f, "find_spec"))
                spec = next((spec for spec in specs if spec is not None), None)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            execute = spec.loader.exec_module

            def exec_module(module):
                undo()
                execute(module)
                callback(module)

            spec.loader.exec_module = exec_module
            return spec

    finder = Finder()
    sys.meta_path.insert(0, finder)

    def undo():
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)

    return undo
