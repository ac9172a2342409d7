"""The recorder's hook on a module's import fires on the import itself, whoever looks for the module
first; and the bootstrap that installs it in every Python process of a job costs that process little."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import gpulab
import gpulab.monitor.record
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


def test_the_hook_fires_on_a_submodule_found_through_its_package_path(tmp_path, monkeypatch):
    """The hook asks the finders after it as the import system asks them (with the package's
    path), as for torch._inductor.cudagraph_trees."""
    (tmp_path / "hooked_pkg").mkdir()
    (tmp_path / "hooked_pkg" / "__init__.py").write_text("")
    (tmp_path / "hooked_pkg" / "inner.py").write_text("VALUE = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fired = []
    undo = after_import("hooked_pkg.inner", fired.append)
    try:
        module = importlib.import_module("hooked_pkg.inner")
        assert fired == [module] and module.VALUE == 2
    finally:
        undo()
        sys.modules.pop("hooked_pkg.inner", None)
        sys.modules.pop("hooked_pkg", None)


AUTOSTART = Path(gpulab.monitor.record.__file__).parent / "autostart"


def test_a_python_process_that_never_imports_torch_loads_no_more_than_a_few_standard_modules(tmp_path):
    """Every Python process of a profiled job runs the bootstrap (an inductor compile on the CPU
    starts six, to probe the vector instructions, and waits for each): it notes the process and
    hooks torch's import, and loads none of what a recording needs (json, re, enum, psutil,
    gpulab.host) until then."""
    src = Path(gpulab.__file__).parents[1]
    env = {**os.environ, "PYTHONPATH": f"{AUTOSTART}{os.pathsep}{src}", "GPULAB_PROFILE_DIR": str(tmp_path)}
    env.pop("GPULAB_PROFILE_PARENT", None)
    out = subprocess.run([sys.executable, "-c", "import sys; print(' '.join(sorted(sys.modules)))"], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert "gpulab.monitor.record.attach" in out
    assert not {"json", "re", "enum", "psutil", "gpulab.host", "gpulab.monitor.events", "torch"} & set(out)
    (record,) = [json.loads(line) for line in next(tmp_path.glob("events-*.jsonl")).read_text().splitlines()]
    assert record["type"] == "process" and record["error"] is None


def test_the_bootstrap_writes_what_json_writes():
    spec = importlib.util.spec_from_file_location("gpulab_bootstrap", AUTOSTART / "sitecustomize.py")
    bootstrap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bootstrap)  # GPULAB_PROFILE_DIR unset here: it only defines its functions
    values = {"type": "process", "pid": 12, "t": 3.25e-05, "none": None, "flag": True,
              "argv": ["python", 'say "hi"\\ there', "tab\tnew\nline\x01\x7f", "naïve ☃ 𝄞", "\udcff"],
              "error": "ValueError: bad\r\x08\x0c"}
    assert bootstrap.to_json(values) == json.dumps(values)
