"""The device report (`gpulab devices --json`) on this machine, whatever it has."""

from __future__ import annotations

import json

import pytest
import torch

from gpulab.hardware.describe import describe

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")

REPORT_KEYS = {
    "torch", "torch_cuda_build", "torch_build", "cudnn", "torch_sees_gpus", "driver", "gpus", "cpu", "verdict", "warnings", "notes",
}
CPU_KEYS = {"model", "logical_cores", "physical_cores", "torch_threads", "memory_total_gib", "memory_available_gib"}
GPU_KEYS = {
    "index", "nvml_index", "cuda_index", "name", "uuid", "memory_used_mib", "memory_total_mib", "utilization_pct",
    "temperature_c", "power_w", "power_limit_w", "error", "mig_enabled", "mig_instances",
}
VERDICT_STATUSES = {"ok", "warning", "error", "no_gpu"}


def test_describe_has_the_documented_keys_and_is_json():
    report = describe()
    assert set(report) == REPORT_KEYS
    assert set(report["cpu"]) == CPU_KEYS
    assert report["torch"] == torch.__version__
    assert report["torch_sees_gpus"] == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert report["cpu"]["logical_cores"] >= 1
    assert 0 < report["cpu"]["memory_available_gib"] <= report["cpu"]["memory_total_gib"]
    assert isinstance(report["warnings"], list) and isinstance(report["notes"], list)
    assert set(report["verdict"]) == {"status", "message", "fix"}
    assert report["verdict"]["status"] in VERDICT_STATUSES
    for gpu in report["gpus"]:
        assert set(gpu) == GPU_KEYS
    json.loads(json.dumps(report))


@no_gpu
def test_describe_without_gpu():
    report = describe()
    assert report["torch_sees_gpus"] == 0
    # NVML may still see GPUs that this torch cannot use; then the verdict must say what is wrong
    if any(g["nvml_index"] is not None for g in report["gpus"]):
        assert report["verdict"]["status"] == "error" and report["verdict"]["fix"]
    else:
        assert report["verdict"]["status"] in {"no_gpu", "warning"}
        assert "training runs on the CPU" in report["verdict"]["message"]


@needs_gpu
def test_describe_numbers_gpus_as_torch_does():
    report = describe()
    assert report["verdict"]["status"] in {"ok", "warning"}
    usable = [g for g in report["gpus"] if g["cuda_index"] is not None]
    assert [g["cuda_index"] for g in usable] == list(range(len(usable)))
    for g in usable:
        assert g["memory_total_mib"] == pytest.approx(torch.cuda.get_device_properties(g["cuda_index"]).total_memory / 2**20, rel=0.05)
