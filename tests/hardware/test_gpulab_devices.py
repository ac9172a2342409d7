"""`gpulab devices` on machines CI does not have: a fake NVML (fake_nvml.py, with the shapes
measured on a real H100) and faked torch facts (torch.version.cuda '13.0' there). With
CUDA_VISIBLE_DEVICES= (empty) gpulab once printed only a vague warning, which these tests replace.
"""

from __future__ import annotations

import json
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch

from gpulab.cli import main
from gpulab.hardware.torch_facts import read_torch
from gpulab.hardware.verdict import cuda_wheel_for
from gpulab.hardware.describe import describe
from tests.hardware.fake_nvml import (
    A100, DRIVER, H100_NAME, H100_UUID, NVML_ERROR_GPU_IS_LOST, NVML_ERROR_LIBRARY_NOT_FOUND, NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_SUPPORTED, TEXT, FakeGpu, bare, machine,
)

OK_MESSAGE = "torch 2.11.0+cu130 (CUDA 13.0) runs on driver 580.159.04 (supports CUDA up to 13.0): 1 GPU usable"

# ----------------------------------------------------------------------------- faking torch


def fake_torch(monkeypatch, *, cuda: str | None = "13.0", uuids: list[str] = (), version="2.11.0+cu130", why_none=None):
    """torch as a build for `cuda` that sees one GPU per entry of `uuids` (torch's bare form)."""
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", None)

    def is_available():
        if cuda is None:
            raise AssertionError("a CPU-only build must not be asked about CUDA")
        if why_none:
            warnings.warn(why_none)
        return bool(uuids)

    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda i: SimpleNamespace(name=f"torch's GPU {i}", uuid=uuids[i], total_memory=80 * 2**30),
    )


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    """rich wraps tables to the terminal's width (80 under pytest): one GPU per line here."""
    monkeypatch.setenv("COLUMNS", "200")


def devices_output(capsys, *args) -> tuple[int, str]:
    code = main(["devices", *args])
    out, err = capsys.readouterr()
    assert err == "" and "Traceback" not in out
    return code, out


def line_with(out: str, text: str) -> str:
    lines = [line for line in out.splitlines() if text in line]
    assert len(lines) == 1, f"{text!r} on {len(lines)} lines of:\n{out}"
    return lines[0]


# ----------------------------------------------------------------------------- one test per verdict


def test_ok_on_the_measured_h100(monkeypatch, capsys):
    machine(monkeypatch, [FakeGpu()])
    fake_torch(monkeypatch, uuids=[bare(H100_UUID)])
    report = describe()
    assert report["verdict"] == {"status": "ok", "message": OK_MESSAGE, "fix": None}
    assert report["driver"] == {"driver": DRIVER, "cuda_driver": "13.0"}
    (gpu,) = report["gpus"]
    assert (gpu["cuda_index"], gpu["nvml_index"], gpu["name"]) == (0, 0, H100_NAME)
    assert report["warnings"] == [] and report["notes"] == []
    code, out = devices_output(capsys)
    assert code == 0
    assert f"ok: {OK_MESSAGE}" in out
    assert "cuda:0" in line_with(out, H100_NAME)


def test_cpu_only_build_with_an_nvidia_gpu_names_the_wheel_for_the_driver(monkeypatch):
    machine(monkeypatch, [FakeGpu()])
    fake_torch(monkeypatch, cuda=None, version="2.13.0+cpu")  # is_available() would raise: never called
    verdict = describe()["verdict"]
    assert verdict["status"] == "error"
    assert verdict["message"] == (
        "1 NVIDIA GPU found, but torch 2.13.0+cpu is a CPU-only build: training would run on the CPU"
    )
    assert verdict["fix"].endswith("pip install torch --index-url https://download.pytorch.org/whl/cu130")
    assert "pip uninstall -y torch" in verdict["fix"]


@pytest.mark.parametrize(
    "driver_cuda, wheel",
    [((13, 0), "cu130"), ((13, 2), "cu130"), ((12, 9), "cu129"), ((12, 7), "cu126"), ((12, 4), "cu124"),
     ((12, 0), "cu118"), ((11, 8), "cu118"), ((11, 7), None)],
)
def test_wheel_is_the_newest_published_not_above_the_drivers_cuda(driver_cuda, wheel):
    assert cuda_wheel_for(driver_cuda) == wheel


def test_driver_too_old_for_the_major_version_is_an_error(monkeypatch):
    machine(monkeypatch, [FakeGpu()], cuda_driver=12040)
    fake_torch(monkeypatch, cuda="13.0", uuids=[])
    verdict = describe()["verdict"]
    assert verdict["status"] == "error"
    assert verdict["message"] == (
        "torch 2.11.0+cu130 is built for CUDA 13.0, but driver 580.159.04 supports CUDA up to 12.4: "
        "a CUDA 13 build cannot run on a driver for CUDA 12"
    )
    assert verdict["fix"] == (
        "upgrade the NVIDIA driver to one that supports CUDA 13.0, or install the wheel for this driver: "
        "pip uninstall -y torch && pip install torch --index-url https://download.pytorch.org/whl/cu124"
    )


def test_driver_older_minor_version_runs_through_minor_version_compatibility(monkeypatch):
    machine(monkeypatch, [FakeGpu()], cuda_driver=12040)
    fake_torch(monkeypatch, cuda="12.8", version="2.11.0+cu128", uuids=[bare(H100_UUID)])
    verdict = describe()["verdict"]
    assert verdict["status"] == "warning"
    assert verdict["message"].startswith("torch 2.11.0+cu128 is built for CUDA 12.8, but driver 580.159.04 supports CUDA up to 12.4")
    assert "minor-version compatibility" in verdict["message"]
    assert "PTX JIT compilation will fail" in verdict["message"]
    assert "whl/cu124" in verdict["fix"]


@pytest.mark.parametrize("visible", ["", "3", "GPU-ffff", "0,0"])
def test_cuda_visible_devices_hiding_every_gpu_says_its_value(monkeypatch, visible):
    machine(monkeypatch, [FakeGpu()], visible=visible)
    fake_torch(monkeypatch, uuids=[])  # what torch sees under such a value
    verdict = describe()["verdict"]
    assert verdict["status"] == "error"
    assert verdict["message"] == (
        f"CUDA_VISIBLE_DEVICES='{visible}' hides every GPU from torch (1 NVIDIA GPU on this machine)"
    )
    assert verdict["fix"] == "unset CUDA_VISIBLE_DEVICES, or set it to GPUs that exist: 0 or their UUIDs (GPU-…, MIG-…)"


def test_torch_seeing_no_gpu_for_another_reason_quotes_cuda(monkeypatch):
    machine(monkeypatch, [FakeGpu()], visible="0")
    fake_torch(
        monkeypatch, uuids=[],
        why_none="CUDA initialization: CUDA unknown error - this may be due to an incorrectly set up environment "
        "(Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:109.)",
    )
    verdict = describe()["verdict"]
    assert verdict["status"] == "error"
    assert verdict["message"] == (
        "1 NVIDIA GPU found, but torch (CUDA 13.0) cannot use them: CUDA initialization: CUDA unknown error - "
        "this may be due to an incorrectly set up environment"
    )
    assert "nvidia-uvm" in verdict["fix"]


def test_some_gpus_hidden_by_cuda_visible_devices_is_a_note_not_an_error(monkeypatch, capsys):
    machine(monkeypatch, [FakeGpu(), A100], visible="1")
    fake_torch(monkeypatch, uuids=[bare(A100.uuid)])
    report = describe()
    assert report["verdict"]["status"] == "ok"
    assert report["notes"] == [
        "1 of 2 GPUs hidden from this process by CUDA_VISIBLE_DEVICES='1': GPU 0 (NVML numbers); "
        "torch numbers the GPUs it sees from cuda:0"
    ]
    by_nvml = {g["nvml_index"]: g["cuda_index"] for g in report["gpus"]}
    assert by_nvml == {0: None, 1: 0}
    _, out = devices_output(capsys)
    assert line_with(out, A100.name).lstrip("│ ").startswith("cuda:0")
    assert line_with(out, H100_NAME).lstrip("│ ").startswith("hidden")


def test_mig_mode_lists_instances_and_says_how_to_pick_one(monkeypatch):
    instance = FakeGpu(name="NVIDIA H100 80GB HBM3 MIG 3g.40gb", uuid="MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee")
    gpu = FakeGpu(mig_mode=[1, 1], mig=[instance, None], fails={"nvmlDeviceGetUtilizationRates": NVML_ERROR_NOT_SUPPORTED})
    machine(monkeypatch, [gpu])
    fake_torch(monkeypatch, uuids=[bare(instance.uuid)])  # torch sees the instance, not the GPU
    report = describe()
    assert report["verdict"]["status"] == "ok"
    (row,) = report["gpus"]
    assert row["mig_enabled"] and row["cuda_index"] is None
    assert [(m["uuid"], m["cuda_index"]) for m in row["mig_instances"]] == [(instance.uuid, 0)]
    (note,) = report["notes"]
    assert note.startswith("GPU 0 is in MIG mode: torch sees its MIG instances, not the whole GPU; ")
    assert "CUDA_VISIBLE_DEVICES=MIG-<uuid>" in note
    assert f"{instance.uuid} ({instance.name}) = cuda:0" in note
    assert report["warnings"] == []  # utilization NOT_SUPPORTED under MIG is 'n/a', not a problem


def test_mig_mode_without_instances_says_torch_cannot_use_the_gpu(monkeypatch):
    machine(monkeypatch, [FakeGpu(mig_mode=[1, 1], mig=[None, None])])
    fake_torch(monkeypatch, uuids=[])
    report = describe()
    assert report["verdict"]["status"] == "error"
    assert report["notes"] == [
        "GPU 0 is in MIG mode with no MIG instance, so torch cannot use it: create one "
        "(nvidia-smi mig -cgi <profile> -C) or turn MIG off (nvidia-smi -i 0 -mig 0)"
    ]


def test_nvml_not_installed_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    fake_torch(monkeypatch, uuids=[bare(H100_UUID)])
    report = describe()
    assert report["driver"] == {"nvml": "nvidia-ml-py is not installed"}
    assert report["verdict"]["status"] == "ok"
    assert report["warnings"] == [
        "GPU details (utilization, temperature, power, memory in use) unavailable: nvidia-ml-py is not installed; "
        "fix: pip install nvidia-ml-py"
    ]
    (gpu,) = report["gpus"]  # listed from torch's own facts
    assert (gpu["cuda_index"], gpu["nvml_index"], gpu["name"]) == (0, None, "torch's GPU 0")
    code, out = devices_output(capsys)
    assert code == 0
    assert line_with(out, "GPU details unavailable:").strip() == "GPU details unavailable: nvidia-ml-py is not installed"


def test_nvml_permission_denied_is_one_line_not_a_traceback(monkeypatch, capsys):
    machine(monkeypatch, [FakeGpu()], init_error=NVML_ERROR_NO_PERMISSION)
    fake_torch(monkeypatch, cuda=None, version="2.13.0+cpu")
    report = describe()
    assert report["driver"] == {"nvml": "permission denied starting NVML (Insufficient Permissions)"}
    assert report["verdict"]["status"] == "warning"
    assert "cannot say whether this machine has an NVIDIA GPU" in report["verdict"]["message"]
    assert "/dev/nvidia*" in report["verdict"]["fix"]
    code, out = devices_output(capsys)
    assert code == 0
    line_with(out, "GPU details unavailable: permission denied starting NVML (Insufficient Permissions)")


@pytest.mark.parametrize("nvml", ["no library", "no GPU"])
def test_no_nvidia_gpu_and_a_cpu_build_is_plain(monkeypatch, capsys, nvml):
    if nvml == "no library":
        machine(monkeypatch, [FakeGpu()], init_error=NVML_ERROR_LIBRARY_NOT_FOUND)
    else:
        machine(monkeypatch, [])
    fake_torch(monkeypatch, cuda=None, version="2.13.0+cpu")
    verdict = describe()["verdict"]
    assert verdict == {
        "status": "no_gpu",
        "message": "no GPU found: training runs on the CPU (use --devices cpu*K to exercise multi-device code)",
        "fix": None,
    }
    code, out = devices_output(capsys)
    assert code == 0 and "no GPU found: training runs on the CPU" in out


# ----------------------------------------------------------------------------- robustness and order


@pytest.mark.parametrize(
    "call",
    ["nvmlDeviceGetHandleByIndex", "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetMemoryInfo",
     "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage"],
)
@pytest.mark.parametrize("error", [NVML_ERROR_GPU_IS_LOST, NVML_ERROR_NO_PERMISSION])
def test_a_failing_gpu_is_one_line_and_the_others_still_print(monkeypatch, capsys, call, error):
    lost = FakeGpu(name="NVIDIA A100-SXM4-80GB", uuid=A100.uuid, fails={call: error})
    machine(monkeypatch, [FakeGpu(), lost])
    fake_torch(monkeypatch, uuids=[bare(H100_UUID)], version="2.11.0+cu130")
    code, out = devices_output(capsys)
    assert code == 0
    assert "cuda:0" in line_with(out, H100_NAME)  # the healthy GPU is still listed, with its numbers
    assert line_with(out, "warning:").strip() == f"warning: GPU 1: NVML error: {TEXT[error]}"
    assert f"ok: {OK_MESSAGE}" in out


def test_a_metric_the_gpu_does_not_support_is_na_without_a_warning(monkeypatch, capsys):
    machine(monkeypatch, [FakeGpu(fails={"nvmlDeviceGetPowerUsage": NVML_ERROR_NOT_SUPPORTED})])
    fake_torch(monkeypatch, uuids=[bare(H100_UUID)])
    report = describe()
    assert report["gpus"][0]["power_w"] is None and report["gpus"][0]["temperature_c"] == 41
    assert report["warnings"] == []


def test_cuda_visible_devices_reorders_and_the_table_follows_torch(monkeypatch, capsys):
    machine(monkeypatch, [FakeGpu(), A100], visible="1,0")
    fake_torch(monkeypatch, uuids=[bare(A100.uuid), bare(H100_UUID)])  # torch's cuda:0 is NVML's GPU 1
    report = describe()
    assert [(g["cuda_index"], g["nvml_index"], g["name"]) for g in report["gpus"]] == [
        (0, 1, A100.name), (1, 0, H100_NAME),
    ]
    assert report["notes"] == []
    _, out = devices_output(capsys)
    a100, h100 = line_with(out, A100.name), line_with(out, H100_NAME)
    assert a100.split("│")[1:3] == [" cuda:0 ", " 1    "] and h100.split("│")[1:3] == [" cuda:1 ", " 0    "]
    assert out.index(A100.name) < out.index(H100_NAME)


def test_json_has_the_verdict_and_both_indices(monkeypatch, capsys):
    machine(monkeypatch, [FakeGpu(), A100], visible="1")
    fake_torch(monkeypatch, uuids=[bare(A100.uuid)])
    code, out = devices_output(capsys, "--json")
    assert code == 0
    report = json.loads(out)
    assert report["verdict"]["status"] == "ok"
    assert set(report["verdict"]) == {"status", "message", "fix"}
    assert [(g["cuda_index"], g["nvml_index"], g["index"]) for g in report["gpus"]] == [(0, 1, 1), (None, 0, 0)]


def test_a_cpu_only_build_never_asks_cuda(monkeypatch):
    fake_torch(monkeypatch, cuda=None, version="2.13.0+cpu")  # is_available() raises if called
    for name in ("device_count", "get_device_properties"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: pytest.fail(f"torch.cuda.{name} called"))
    facts = read_torch()
    assert facts.cpu_only and facts.devices == []
