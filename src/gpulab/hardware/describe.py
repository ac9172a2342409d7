"""Everything `gpulab devices` shows, as plain data: the torch build, the GPUs (NVML's facts in
torch's order), the CPU, one verdict and the warnings and notes around it."""

from __future__ import annotations

import platform

import psutil
import torch

from gpulab.hardware.matching import match_gpus, notes
from gpulab.hardware.nvml_facts import Gpu, NvmlFacts, gpu_problems, read_nvml
from gpulab.hardware.torch_facts import TorchFacts, read_torch
from gpulab.hardware.verdict import judge, nvml_fix
from gpulab.hardware.visible import cuda_visible_devices


def describe() -> dict:
    """Everything `gpulab devices` shows, as plain data (also its --json output).

    Never raises for a GPU problem: a missing NVML, a lost GPU or a refused call becomes a line
    in `warnings` (or the `verdict`), so `gpulab devices` and `gpulab bench` still report the rest.
    """
    torch_facts = read_torch()
    nvml = read_nvml()
    gpus = match_gpus(nvml, torch_facts)
    visible = cuda_visible_devices()
    verdict = judge(torch_facts, nvml, visible)
    return {
        "torch": torch.__version__,
        "torch_cuda_build": torch.version.cuda,  # None on a CPU-only build
        "torch_build": torch_facts.build(),  # "CUDA 13.0", "ROCm/HIP 6.2" or "CPU-only"
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "torch_sees_gpus": len(torch_facts.devices),
        "driver": _driver_facts(nvml),
        "gpus": [g.to_dict() for g in gpus],
        "cpu": {
            "model": _cpu_model(),
            "logical_cores": psutil.cpu_count(logical=True),
            "physical_cores": psutil.cpu_count(logical=False),
            "torch_threads": torch.get_num_threads(),
            "memory_total_gib": psutil.virtual_memory().total / 2**30,
            "memory_available_gib": psutil.virtual_memory().available / 2**30,
        },
        "verdict": verdict.to_dict(),
        "warnings": _warnings(nvml, gpus, torch_facts),
        "notes": notes(gpus, torch_facts, visible),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _driver_facts(nvml: NvmlFacts) -> dict:
    """{'driver': '580.159.04', 'cuda_driver': '13.0'}, or {'nvml': why NVML said nothing}."""
    if nvml.unavailable:
        return {"nvml": nvml.why}
    facts = {"driver": nvml.driver}
    if nvml.cuda_driver:
        facts["cuda_driver"] = f"{nvml.cuda_driver[0]}.{nvml.cuda_driver[1]}"
    return facts


def _warnings(nvml: NvmlFacts, gpus: list[Gpu], torch_facts: TorchFacts) -> list[str]:
    """Problems besides the verdict: GPUs NVML could not read, NVML missing while torch has GPUs."""
    lines = [*nvml.problems, *gpu_problems(gpus)]
    if nvml.unavailable and torch_facts.devices:
        fix = nvml_fix(nvml)
        lines.append(
            f"GPU details (utilization, temperature, power, memory in use) unavailable: {nvml.why}"
            + (f"; fix: {fix}" if fix else "")
        )
    return lines
