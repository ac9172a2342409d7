"""The codebase's shape (issues 12 and 24), checked in the default suite so CI keeps it:

- gpulab's modules import one another one way only - no cycle of any length, imports inside
  functions included (a lazy import that closes a circle is still a circle);
- the profiler is split at its event format: the analysis and the output read events, never
  torch or the recorder; the parent process of `gpulab profile` (monitor/parent/) never imports
  torch; the recording side is made of probes that never reach into one another (they write
  through the sink and learn through notices);
- no class of the profiler is over 200 lines;
- `gpulab plan` is split the same way (issue 34): the side that starts the measuring children and
  reads their results never imports torch, and the child that profiles a step imports what it
  needs at its top.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "gpulab"


def module_name(path: Path) -> str:
    parts = ("gpulab", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth in the file, as dotted names: `import a.b` is
    a.b; `from a import b` is a.b when that is a module, else a (b is a name defined in a)."""
    is_package = path.name == "__init__.py"
    package = module_name(path).split(".")[: None if is_package else -1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                found.add(submodule if _is_module(submodule) else module)
    return found


def _is_module(name: str) -> bool:
    if not name.startswith("gpulab."):
        return False
    relative = Path(*name.split(".")[1:])
    return (SRC / relative).with_suffix(".py").is_file() or (SRC / relative / "__init__.py").is_file()


def import_graph() -> dict[str, set[str]]:
    """gpulab module (a package is its __init__) -> the gpulab modules it names in its imports.
    Importing gpulab.x.y also runs gpulab/x/__init__.py; that implicit step is not an edge."""
    files = {module_name(p): p for p in SRC.rglob("*.py")}
    return {name: {m for m in imported_modules(path) if m in files and m != name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle (a path that returns to its start), by depth-first search, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_imports_however_they_are_written():
    graph = import_graph()
    assert "gpulab.parallel.distributed" in graph["gpulab.train.build"]  # from a.b import C
    assert "gpulab.devices" in graph["gpulab.parallel.data_parallel"]
    assert "gpulab.models" in graph["gpulab.train.loop"]  # from gpulab import models (a package)
    assert "gpulab.parallel" in graph["gpulab.train.build"]  # from gpulab.parallel import DataParallel
    assert "gpulab.monitor.record.lifetime" in graph["gpulab.monitor.record.attach"]  # inside a function


def test_gpulab_s_modules_import_one_way():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle between gpulab's modules: " + " -> ".join(cycle)


def _files_under(folder: str) -> list[Path]:
    return sorted((SRC / folder).rglob("*.py"))


def test_the_analysis_and_the_output_read_events_only():
    """analyze/, output/ and the parent's side of alive/ may read events (monitor/events.py), never
    torch or the recorder; of alive/, only child.py runs inside the job."""
    alive = [p for p in _files_under("monitor/alive") if p.name != "child.py"]
    assert {p.name for p in alive} >= {"protocol.py", "watch.py", "hang.py", "stall.py", "failure.py"}
    files = _files_under("monitor/analyze") + _files_under("monitor/output") + alive + [SRC / "monitor" / "events.py"]
    assert len(files) > 5
    for path in files:
        forbidden = {m for m in imported_modules(path)
                     if m.split(".")[0] == "torch" or m.startswith("gpulab.monitor.record")}
        assert not forbidden, f"{path.relative_to(SRC)} imports {sorted(forbidden)}"


def test_gpulab_profile_s_parent_never_imports_torch():
    """The runner, the job, the hang watch, the sampler, --try, the analysis and the output load
    without torch (2-3 s, and a parent that imports torch could change the job's environment); no
    module of monitor/parent/ names torch or the recording side at all."""
    code = ("import sys\n"
            "import gpulab.monitor.cli, gpulab.monitor.parent.runner, gpulab.monitor.parent.trial\n"
            "import gpulab.monitor.parent.job, gpulab.monitor.alive.watch, gpulab.monitor.parent.sampler\n"
            "import gpulab.monitor.output.report, gpulab.monitor.analyze.diagnose, gpulab.monitor.record.attach\n"
            "import gpulab.hardware.nvml\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    files = _files_under("monitor/parent")
    assert {p.name for p in files} >= {"runner.py", "job.py", "sampler.py", "trial.py"}
    for path in files:
        forbidden = {m for m in imported_modules(path)
                     if m.split(".")[0] == "torch" or m.startswith("gpulab.monitor.record")}
        assert not forbidden, f"{path.relative_to(SRC)} imports {sorted(forbidden)}"


MAX_CLASS_LINES = 200


def classes_over(path: Path, limit: int) -> list[str]:
    """`Name: N lines` for each class in the file longer than `limit` lines (nested ones too)."""
    return [f"{node.name}: {node.end_lineno - node.lineno + 1} lines"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > limit]


def test_the_class_length_check_counts_lines(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("class Small:\n    x = 1\n\n\nclass Big:\n" + "    y = 1\n" * 4)
    assert classes_over(path, 4) == ["Big: 5 lines"]


def test_no_class_of_the_profiler_is_over_200_lines():
    files = _files_under("monitor")
    assert len(files) > 40
    long = [f"{path.relative_to(SRC)}: {c}" for path in files for c in classes_over(path, MAX_CLASS_LINES)]
    assert not long, f"classes over {MAX_CLASS_LINES} lines: {long}"


def test_a_probe_reaches_into_no_other_probe():
    """A probe writes through the sink and learns what others see from notices: no probe module
    imports the recorder or another module's probe (a helper function or part is fine: the CUDA
    probe's device test, the distributed probe's DDP wait); the recorder imports every probe."""
    probes = [p for p in _files_under("monitor/record/probes") if p.name != "__init__.py"]
    assert len(probes) >= 10
    for path in probes:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gpulab.monitor.record"):
                assert node.module != "gpulab.monitor.record.recorder", f"{path.name} imports the recorder"
                if node.module.startswith("gpulab.monitor.record.probes."):
                    taken = [a.name for a in node.names if a.name.endswith("Probe")]
                    assert not taken, f"{path.name} imports {taken} from {node.module}"
    recorder = imported_modules(SRC / "monitor" / "record" / "recorder.py")
    defining = {module_name(p) for p in probes if "(Probe)" in p.read_text() or "(WindowProbe)" in p.read_text()}
    assert len(defining) >= 10 and defining <= recorder, sorted(defining - recorder)


def imports_inside_functions(path: Path) -> list[str]:
    """`line: statement` for every import in the body of a function (a lazy import), once each
    (a nested function's is also its outer function's)."""
    found = {node.lineno: ast.unparse(node)
             for fn in ast.walk(ast.parse(path.read_text())) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
             for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))}
    return [f"{line}: {text}" for line, text in sorted(found.items())]


def test_the_lazy_import_finder_finds_them(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import os\n\ndef f():\n    def g():\n        from a import b\n    return os\n")
    assert imports_inside_functions(path) == ["5: from a import b"]


def test_gpulab_plan_s_parent_never_imports_torch():
    """`gpulab plan`'s parent loads without torch (a GPU plan asks torch what devices there are,
    nothing more); one device's step is measured by a child, plan/profile_step.py (step.CHILD),
    which step.py starts by name and never imports."""
    code = ("import sys\n"
            "import gpulab.plan.cli, gpulab.plan.planner, gpulab.plan.check, gpulab.plan.render\n"
            "import gpulab.plan.step, gpulab.plan.collective, gpulab.plan.predict, gpulab.plan.peak_memory\n"
            "print(sorted(m for m in sys.modules\n"
            "             if m == 'torch' or m.startswith('torch.') or m == 'gpulab.plan.profile_step'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    from gpulab.plan.step import CHILD

    assert CHILD == "gpulab.plan.profile_step" and _is_module(CHILD)
    forbidden = {m for m in imported_modules(SRC / "plan" / "step.py") if m.split(".")[0] == "torch" or m == CHILD}
    assert not forbidden, f"plan/step.py imports {sorted(forbidden)}"


def test_the_step_s_parent_and_child_import_at_their_top():
    """Split at the JSON between them, neither needs an import inside a function to stay light:
    the parent imports no torch at all, the child torch and gpulab train from the start."""
    for name in ("step.py", "profile_step.py"):
        lazy = imports_inside_functions(SRC / "plan" / name)
        assert not lazy, f"plan/{name} imports inside functions: {lazy}"
    assert "torch" in imported_modules(SRC / "plan" / "profile_step.py")
