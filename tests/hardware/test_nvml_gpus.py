"""The one reader of the GPUs (gpulab.hardware.nvml_gpus): the only module that asks NVML anything
(nvml.py only starts and stops it), static facts read once, readings on request, and the imports
that keep it usable from the profiler's torch-free parent."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from gpulab.hardware.nvml import Queries
from gpulab.hardware.nvml_gpus import list_gpus
from tests.hardware.fake_nvml import A100, H100_NAME, H100_UUID, NVML_ERROR_GPU_IS_LOST, FakeGpu, machine

SRC = Path(__file__).resolve().parents[2] / "src" / "gpulab"
STARTING = {"nvmlInit", "nvmlShutdown"}  # nvml.py's: starting NVML, not asking it anything


def _nvml_names(path: Path) -> set[str]:
    """The NVML functions and types a file names (`nv.nvmlDeviceGetName`, `nv.c_nvmlGpmMetricsGet_t`)."""
    return {node.attr for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and re.match(r"(c_)?nvml[A-Z]", node.attr)}


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_only_the_gpu_reader_asks_nvml():
    askers = {str(p.relative_to(SRC)): names - STARTING for p in SRC.rglob("*.py") if (names := _nvml_names(p))}
    assert {p for p, names in askers.items() if names} == {"hardware/nvml_gpus.py"}
    assert _nvml_names(SRC / "hardware" / "nvml.py") == STARTING
    importers = {str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if "pynvml" in _imports(p)}
    assert importers == {"hardware/nvml.py"}


def test_hardware_never_imports_the_monitor():
    for path in (SRC / "hardware").glob("*.py"):
        assert not {m for m in _imports(path) if m.startswith("gpulab.monitor")}, path.name


def test_the_nvml_side_of_hardware_loads_without_torch():
    code = ("import sys\n"
            "import gpulab.hardware.nvml, gpulab.hardware.nvml_gpus, gpulab.hardware.nvml_facts\n"
            "import gpulab.hardware.visible\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_static_facts_are_read_once_and_readings_on_each_request(monkeypatch):
    nv = machine(monkeypatch, [FakeGpu(), A100])
    gpus = list_gpus(Queries(nv))
    for _ in range(3):
        assert [(g.index, g.name, g.uuid, g.memory_total_mib) for g in gpus] == [
            (0, H100_NAME, H100_UUID, 81559), (1, A100.name, A100.uuid, 81559)]
        assert [g.mig_instances for g in gpus] == [None, None]  # not in MIG mode
        readings = Queries(nv)
        assert [readings.query("power", g.power_w) for g in gpus] == [123.0, 123.0]
    assert nv.calls["nvmlDeviceGetName"] == nv.calls["nvmlDeviceGetUUID"] == nv.calls["nvmlDeviceGetMigMode"] == 2
    assert nv.calls["nvmlDeviceGetMemoryInfo"] == 2 and nv.calls["nvmlDeviceGetPowerUsage"] == 6


def test_a_gpu_without_a_handle_has_no_facts_and_says_why(monkeypatch):
    nv = machine(monkeypatch, [FakeGpu(fails={"nvmlDeviceGetHandleByIndex": NVML_ERROR_GPU_IS_LOST})])
    (gpu,) = list_gpus(Queries(nv))
    assert (gpu.handle, gpu.name, gpu.uuid, gpu.memory_total_mib, gpu.mig_instances) == (None, None, None, None, None)
    assert sum(nv.calls.values()) == 0  # nothing asked of a GPU NVML could not open
    assert gpu.queries.problems == {"handle": "NVML error: GPU is lost"}


def test_mig_instances_are_read_through_their_gpu_s_queries(monkeypatch):
    lost = FakeGpu(name="NVIDIA H100 80GB HBM3 MIG 3g.40gb", uuid="MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee",
                   fails={"nvmlDeviceGetName": NVML_ERROR_GPU_IS_LOST})
    nv = machine(monkeypatch, [FakeGpu(mig_mode=[1, 1], mig=[None, lost])])
    (gpu,) = list_gpus(Queries(nv))
    (instance,) = gpu.mig_instances  # the empty slot is skipped, not a problem
    assert (instance.uuid, instance.name, instance.memory_total_mib) == (lost.uuid, None, 81559)
    assert gpu.queries.problem == "NVML error: GPU is lost"  # the instance's failure is its GPU's problem
