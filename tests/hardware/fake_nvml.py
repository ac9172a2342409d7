"""A fake pynvml for machines CI does not have, shared by the tests of `gpulab devices` and of the
profiler's sampler (both read NVML through gpulab.hardware.nvml_gpus, the one reader of the GPUs).

The shapes faked here are the ones measured on a real H100 (torch 2.11.0+cu130):
    nvmlSystemGetDriverVersion()                '580.159.04'
    nvmlSystemGetCudaDriverVersion()            13000      (_v2 also 13000; 13000 = CUDA 13.0)
    nvmlSystemGetNVMLVersion()                  '13.580.159.04'
    nvmlDeviceGetCount()                        1
    nvmlDeviceGetName(h)                        'NVIDIA H100 80GB HBM3'
    nvmlDeviceGetUUID(h)                        'GPU-0db07a0e-dc2d-4caa-5b67-461cdb9ae06e'
    torch.cuda.get_device_properties(0).uuid    prints '0db07a0e-dc2d-4caa-5b67-461cdb9ae06e'
    nvmlDeviceGetMigMode(h)                     [0, 0]
A function the fake lacks (GPM, field values, clocks) behaves as in an nvidia-ml-py without it.
"""

from __future__ import annotations

import sys
import types
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

H100_NAME = "NVIDIA H100 80GB HBM3"
H100_UUID = "GPU-0db07a0e-dc2d-4caa-5b67-461cdb9ae06e"
DRIVER = "580.159.04"

# The NVML_ERROR_* codes and texts gpulab relies on (the values are nvml.h's, as pynvml has them).
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999
TEXT = {
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}
MISSING = "missing"  # as a `fails` value: this nvidia-ml-py lacks the function


class FakeNVMLError(Exception):
    """pynvml.NVMLError's shape: an int `.value`, and str() is NVML's text for it."""

    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return TEXT[self.value]


@dataclass
class FakeGpu:
    name: str = H100_NAME
    uuid: str = H100_UUID
    used_mib: int = 1024
    total_mib: int = 81559
    mig_mode: list = field(default_factory=lambda: [0, 0])
    mig: list = field(default_factory=list)  # [FakeGpu | None] per MIG slot; None = empty slot
    # pynvml function name -> what it does instead of answering: an NVML error code to raise,
    # an exception to raise, or MISSING (the module lacks the function; for every GPU then).
    fails: dict = field(default_factory=dict)


A100 = FakeGpu(name="NVIDIA A100-SXM4-80GB", uuid="GPU-11111111-2222-3333-4444-555555555555")


def fake_pynvml(gpus: list[FakeGpu], *, init_error: int | None = None, cuda_driver: int | None = 13000):
    """A module with the pynvml functions gpulab calls, answering from `gpus`; `calls` counts the
    calls of each per-GPU function."""
    nv = types.ModuleType("pynvml")
    nv.NVMLError = FakeNVMLError
    for name, value in globals().items():
        if name.startswith("NVML_ERROR_"):
            setattr(nv, name, value)
    nv.NVML_SUCCESS = 0
    nv.NVML_TEMPERATURE_GPU = 0
    nv.calls = Counter()

    def init():
        if init_error is not None:
            raise FakeNVMLError(init_error)

    def per_gpu(fname, answer):
        def call(handle, *args):
            nv.calls[fname] += 1
            failure = handle.fails.get(fname)
            if isinstance(failure, int):
                raise FakeNVMLError(failure)
            if isinstance(failure, Exception):
                raise failure
            return answer(handle, *args)

        return call

    def handle_by_index(i):
        if "nvmlDeviceGetHandleByIndex" in gpus[i].fails:
            raise FakeNVMLError(gpus[i].fails["nvmlDeviceGetHandleByIndex"])
        return gpus[i]

    def cuda_driver_version():
        if cuda_driver is None:
            raise FakeNVMLError(NVML_ERROR_NOT_SUPPORTED)
        return cuda_driver

    def mig_handle(g, slot):
        if g.mig[slot] is None:
            raise FakeNVMLError(NVML_ERROR_NOT_FOUND)
        return g.mig[slot]

    nv.nvmlInit = init
    nv.nvmlShutdown = lambda: None
    nv.nvmlSystemGetDriverVersion = lambda: DRIVER
    nv.nvmlSystemGetCudaDriverVersion = cuda_driver_version
    nv.nvmlDeviceGetCount = lambda: len(gpus)
    nv.nvmlDeviceGetHandleByIndex = handle_by_index
    for fname, answer in {
        "nvmlDeviceGetName": lambda g: g.name,
        "nvmlDeviceGetUUID": lambda g: g.uuid,
        "nvmlDeviceGetMemoryInfo": lambda g: SimpleNamespace(used=g.used_mib * 2**20, total=g.total_mib * 2**20),
        "nvmlDeviceGetUtilizationRates": lambda g: SimpleNamespace(gpu=37, memory=5),
        "nvmlDeviceGetTemperature": lambda g, sensor: 41,
        "nvmlDeviceGetPowerUsage": lambda g: 123_000,
        "nvmlDeviceGetEnforcedPowerLimit": lambda g: 700_000,
        "nvmlDeviceGetMigMode": lambda g: g.mig_mode,
        "nvmlDeviceGetMaxMigDeviceCount": lambda g: len(g.mig),
        "nvmlDeviceGetMigDeviceHandleByIndex": mig_handle,
    }.items():
        if not any(g.fails.get(fname) == MISSING for g in gpus):
            setattr(nv, fname, per_gpu(fname, answer))
    return nv


def machine(monkeypatch, gpus, *, visible=None, **nvml_options):
    """This process on a machine with `gpus`, under CUDA_VISIBLE_DEVICES=`visible` (None: unset)."""
    nv = fake_pynvml(gpus, **nvml_options)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    return nv


def bare(uuid: str) -> str:
    return uuid.split("-", 1)[1]  # how torch prints it: without NVML's 'GPU-' / 'MIG-'
