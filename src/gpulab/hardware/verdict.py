"""One verdict on this installation, from NVML's and torch's facts: can this torch use these GPUs?
(torch's build vs the driver, CUDA_VISIBLE_DEVICES hiding every GPU, CUDA failing to start), and
its fix: which wheel to install for this driver, or what to check.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from gpulab.hardware.nvml_facts import NvmlFacts
from gpulab.hardware.torch_facts import TorchFacts
from gpulab.hardware.visible import parse_cuda_visible_devices

# The CUDA versions PyTorch publishes wheels for (https://download.pytorch.org/whl/cuXYZ).
PUBLISHED_CUDA_WHEELS: tuple[tuple[int, int], ...] = ((11, 8), (12, 1), (12, 4), (12, 6), (12, 8), (12, 9), (13, 0))
WHEEL_INDEX = "https://download.pytorch.org/whl"


@dataclass(frozen=True)
class Verdict:
    status: str  # "ok" | "warning" | "error" | "no_gpu"
    message: str
    fix: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def cuda_wheel_for(driver_cuda: tuple[int, int]) -> str | None:
    """The newest published 'cuXYZ' wheel tag not above what the driver supports, or None."""
    fitting = [v for v in PUBLISHED_CUDA_WHEELS if v <= driver_cuda]
    return f"cu{fitting[-1][0]}{fitting[-1][1]}" if fitting else None


def install_command(tag: str) -> str:
    # Uninstall first: with any torch installed, `pip install torch` is already "satisfied"
    # and would keep the wrong build.
    return f"pip uninstall -y torch && pip install torch --index-url {WHEEL_INDEX}/{tag}"


def _version(text: str | None) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _fmt(v: tuple[int, int] | None) -> str:
    return f"{v[0]}.{v[1]}" if v else "?"


def _gpus(n: int) -> str:
    return f"{n} GPU" + ("" if n == 1 else "s")


def _wheel_fix(nvml: NvmlFacts) -> str:
    """Which CUDA wheel to install for this driver, as a command."""
    if nvml.cuda_driver is None:
        return (
            "install the CUDA wheel not newer than the 'CUDA Version' nvidia-smi shows, e.g. "
            f"{install_command('cu126')} (published: "
            + ", ".join(f"cu{a}{b}" for a, b in PUBLISHED_CUDA_WHEELS) + ")"
        )
    tag = cuda_wheel_for(nvml.cuda_driver)
    if tag is None:
        oldest = PUBLISHED_CUDA_WHEELS[0]
        return (
            f"upgrade the NVIDIA driver: driver {nvml.driver} supports CUDA up to {_fmt(nvml.cuda_driver)}, "
            f"and the oldest CUDA wheel of torch needs CUDA {_fmt(oldest)}"
        )
    return f"install the wheel for this driver: {install_command(tag)}"


def judge(torch_facts: TorchFacts, nvml: NvmlFacts, visible: str | None) -> Verdict:
    """One verdict on this installation, from the facts; `visible` is CUDA_VISIBLE_DEVICES."""
    seen = len(torch_facts.devices)
    if nvml.unavailable:
        return _judge_without_nvml(torch_facts, nvml)
    if not nvml.gpus:
        if seen:
            return Verdict("ok", f"torch {torch_facts.version} ({torch_facts.build()}) sees {_gpus(seen)}: usable")
        return no_gpu()
    n = len(nvml.gpus)
    found = f"{n} NVIDIA GPU" + ("" if n == 1 else "s")
    if torch_facts.cpu_only:
        return Verdict(
            "error",
            f"{found} found, but torch {torch_facts.version} is a CPU-only build: training would run on the CPU",
            _wheel_fix(nvml),
        )
    if torch_facts.cuda is None:
        return Verdict(
            "error",
            f"{found} found, but torch {torch_facts.version} is a ROCm (HIP {torch_facts.hip}) build, for AMD GPUs",
            _wheel_fix(nvml),
        )
    too_old = _driver_too_old(torch_facts, nvml, seen)
    if too_old:
        return too_old
    if seen == 0:
        return _judge_none_seen(torch_facts, nvml, visible, found)
    supports = f"supports CUDA up to {_fmt(nvml.cuda_driver)}" if nvml.cuda_driver else "its CUDA version unknown"
    return Verdict(
        "ok",
        f"torch {torch_facts.version} (CUDA {torch_facts.cuda}) runs on driver {nvml.driver} ({supports}): "
        f"{_gpus(seen)} usable",
    )


def no_gpu() -> Verdict:
    return Verdict("no_gpu", "no GPU found: training runs on the CPU (use --devices cpu*K to exercise multi-device code)")


def _judge_without_nvml(torch_facts: TorchFacts, nvml: NvmlFacts) -> Verdict:
    seen = len(torch_facts.devices)
    if seen:
        # torch works; only the details NVML gives are missing (a separate warning says so).
        return Verdict(
            "ok", f"torch {torch_facts.version} ({torch_facts.build()}) sees {_gpus(seen)}: usable (driver not known: {nvml.why})"
        )
    if nvml.unavailable == "no_driver":
        return no_gpu()  # no NVIDIA driver: no NVIDIA GPU this machine can use
    return Verdict(
        "warning",
        f"torch sees no GPU, and NVML cannot say whether this machine has an NVIDIA GPU ({nvml.why}): "
        "training runs on the CPU",
        nvml_fix(nvml),
    )


def nvml_fix(nvml: NvmlFacts) -> str | None:
    """How to get NVML's details back, for the reasons that have a fix."""
    return {
        "not_installed": "pip install nvidia-ml-py",
        "no_permission": "run as a user who may open /dev/nvidia* (often the 'video' group), "
        "or ask the administrator for GPU access",
        "error": "run nvidia-smi: if it fails the same way, reload the NVIDIA driver or reboot",
    }.get(nvml.unavailable or "")


def _driver_too_old(torch_facts: TorchFacts, nvml: NvmlFacts, seen: int) -> Verdict | None:
    built, supported = _version(torch_facts.cuda), nvml.cuda_driver
    if built is None or supported is None or built <= supported:
        return None
    head = f"torch {torch_facts.version} is built for CUDA {_fmt(built)}, but {_driver_text(nvml)}"
    tag = cuda_wheel_for(supported)
    fix = f"upgrade the NVIDIA driver to one that supports CUDA {_fmt(built)}" + (
        f", or install the wheel for this driver: {install_command(tag)}" if tag else ""
    )
    if built[0] != supported[0]:
        return Verdict("error", f"{head}: a CUDA {built[0]} build cannot run on a driver for CUDA {supported[0]}", fix)
    # Same major version: CUDA's minor-version compatibility lets the build run on the older
    # driver, except code the driver must JIT-compile from PTX newer than it understands.
    if seen:
        return Verdict(
            "warning",
            f"{head}: it runs through CUDA minor-version compatibility, but kernels that need PTX JIT compilation will fail",
            fix,
        )
    return Verdict(
        "error",
        f"{head}, and torch sees no GPU ({_why_none(torch_facts)}); even where CUDA minor-version "
        "compatibility lets it run, kernels that need PTX JIT compilation fail",
        fix,
    )


def _why_none(torch_facts: TorchFacts) -> str:
    return torch_facts.why_none or "torch.cuda.is_available() is False"


def _driver_text(nvml: NvmlFacts) -> str:
    if nvml.cuda_driver is None:
        return f"driver {nvml.driver} (its CUDA version unknown)"
    return f"driver {nvml.driver} supports CUDA up to {_fmt(nvml.cuda_driver)}"


def _judge_none_seen(torch_facts: TorchFacts, nvml: NvmlFacts, visible: str | None, found: str) -> Verdict:
    n = len(nvml.gpus)
    mig_uuids = [[m.uuid for m in g.mig_instances] for g in nvml.gpus]
    if visible is not None and not parse_cuda_visible_devices(visible, [g.uuid for g in nvml.gpus], mig_uuids):
        ids = "0" if n == 1 else f"0..{n - 1}"
        return Verdict(
            "error",
            f"CUDA_VISIBLE_DEVICES='{visible}' hides every GPU from torch ({found} on this machine)",
            f"unset CUDA_VISIBLE_DEVICES, or set it to GPUs that exist: {ids} or their UUIDs (GPU-…, MIG-…)",
        )
    why = _why_none(torch_facts)
    return Verdict(
        "error",
        f"{found} found, but torch (CUDA {torch_facts.cuda}) cannot use them: {why}",
        "NVML works, so CUDA itself failed to start: check that /dev/nvidia-uvm exists (sudo modprobe nvidia-uvm), "
        "that a container was started with GPU access, and reboot after a driver upgrade",
    )
