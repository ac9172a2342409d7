"""The recorder's hook on a module's import fires on the import itself, whoever looks for the module first."""

from __future__ import annotations

import importlib
import importlib.util
import sys

from gpulab import bytecode
from gpulab.monitor.record.interpreter import after_import


def test_the_hook_survives_a_lookup_that_imports_nothing(tmp_path, monkeypatch):
    """`importlib.util.find_spec("torch")` is how scripts ask whether torch is there; the
    recorder's start hangs on torch's import, which comes after."""
    (tmp_path / "hooked_mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fired = []
    undo = after_import("hooked_mod", fired.append)
    try:
        assert importlib.util.find_spec("hooked_mod") is not None
        assert not fired
        module = importlib.import_module("hooked_mod")
        assert fired == [module] and module.VALUE == 1
        assert not [f for f in sys.meta_path if type(f).__name__ == "Finder"]  # gone once it fired
    finally:
        undo()
        sys.modules.pop("hooked_mod", None)


def test_gpulab_s_start_up_looks_for_torch_without_asking_import_hooks(tmp_path, monkeypatch):
    asked = []

    class Watching:
        def find_spec(self, fullname, path=None, target=None):
            asked.append(fullname)
            return None

    (tmp_path / "probe_pkg").mkdir()
    (tmp_path / "probe_pkg" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", [Watching(), *sys.meta_path])
    assert bytecode.module_source("probe_pkg") == tmp_path / "probe_pkg" / "__init__.py"
    assert asked == []
