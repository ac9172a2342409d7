"""Can this torch use this machine's GPUs? The facts, matched up, and one verdict with its fix.

Three sources, each asked cheaply and none trusted to work:
- NVML (nvidia-ml-py) lists every NVIDIA GPU the driver knows, in NVML (PCI) order, with the
  driver's version and the newest CUDA it supports. It may be missing, refuse us, or fail on
  one GPU (lost, no permission): read through `nvml.Queries`, each failure is n/a and, when it
  is a problem, a line of text, never a traceback.
- torch says which build it is (CUDA x.y, ROCm, or CPU-only) and which GPUs *it* can use, in
  its own order: `cuda:N` after CUDA_VISIBLE_DEVICES. A CPU-only build is never asked.
- CUDA_VISIBLE_DEVICES, read by `visible.py` as CUDA reads it, to say why GPUs are hidden.

NVML's GPUs are matched to torch's by UUID (NVML writes 'GPU-<uuid>' or 'MIG-<uuid>', torch the
bare '<uuid>'), so the report numbers GPUs as `cuda:N` means them.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import asdict, dataclass, field

import torch

from gpulab.hardware.nvml import Queries, as_str, mig_instance_handles, start_nvml, stop_nvml
from gpulab.hardware.visible import parse_cuda_visible_devices

# The CUDA versions PyTorch publishes wheels for (https://download.pytorch.org/whl/cuXYZ).
PUBLISHED_CUDA_WHEELS: tuple[tuple[int, int], ...] = ((11, 8), (12, 1), (12, 4), (12, 6), (12, 8), (12, 9), (13, 0))
WHEEL_INDEX = "https://download.pytorch.org/whl"

# ----------------------------------------------------------------------------- records


@dataclass
class MigInstance:
    """One MIG instance of a GPU in MIG mode: what torch sees as a `cuda:N` there."""

    uuid: str | None
    name: str | None
    memory_total_mib: float | None
    cuda_index: int | None = None


@dataclass
class Gpu:
    """One GPU as the report shows it; `error` says why some of its fields are missing."""

    nvml_index: int | None
    cuda_index: int | None = None
    name: str | None = None
    uuid: str | None = None
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None
    utilization_pct: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    error: str | None = None
    mig_enabled: bool = False
    mig_instances: list[MigInstance] = field(default_factory=list)

    @property
    def usable(self) -> bool:
        """torch can use this GPU, whole or through one of its MIG instances."""
        return self.cuda_index is not None or any(m.cuda_index is not None for m in self.mig_instances)

    @property
    def first_cuda_index(self) -> int | None:
        found = [i for i in [self.cuda_index, *(m.cuda_index for m in self.mig_instances)] if i is not None]
        return min(found) if found else None

    def label(self) -> str:
        """'GPU 1' (NVML's number, as nvidia-smi shows it), plus 'cuda:0' when torch uses it."""
        if self.nvml_index is None:
            return f"cuda:{self.cuda_index}"
        return f"GPU {self.nvml_index}" + (f" (cuda:{self.cuda_index})" if self.cuda_index is not None else "")

    def to_dict(self) -> dict:
        row = asdict(self)
        # 'index' is the key readers of older reports use: NVML's number when NVML answered.
        row["index"] = self.nvml_index if self.nvml_index is not None else self.cuda_index
        return row


@dataclass
class NvmlFacts:
    """What NVML said, or why it said nothing (`unavailable`, with `why` and a fix)."""

    unavailable: str | None = None  # None | "not_installed" | "no_driver" | "no_permission" | "error"
    why: str | None = None
    driver: str | None = None
    cuda_driver: tuple[int, int] | None = None  # the newest CUDA this driver supports
    gpus: list[Gpu] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # driver-wide reads that failed


@dataclass
class TorchDevice:
    index: int
    name: str | None
    uuid: str | None  # bare, lower case
    memory_total_mib: float | None


@dataclass
class TorchFacts:
    version: str
    cuda: str | None  # torch.version.cuda: '13.0', None on ROCm and CPU-only builds
    hip: str | None  # torch.version.hip: set on ROCm builds
    devices: list[TorchDevice] = field(default_factory=list)
    why_none: str | None = None  # CUDA's own reason when a GPU build sees no GPU

    @property
    def cpu_only(self) -> bool:
        return self.cuda is None and self.hip is None

    def build(self) -> str:
        if self.cuda:
            return f"CUDA {self.cuda}"
        if self.hip:
            return f"ROCm/HIP {self.hip}"
        return "CPU-only"


@dataclass(frozen=True)
class Verdict:
    status: str  # "ok" | "warning" | "error" | "no_gpu"
    message: str
    fix: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- torch


def read_torch() -> TorchFacts:
    """torch's build and the GPUs it can use, in `cuda:N` order."""
    facts = TorchFacts(torch.__version__, torch.version.cuda, getattr(torch.version, "hip", None))
    if facts.cpu_only:
        return facts  # nothing to ask: a CPU-only build has no CUDA to initialise
    # When CUDA fails to start, torch says why only in a warning and returns False.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    if not available:
        facts.why_none = _cuda_warning(caught)
        return facts
    facts.devices = [_torch_device(i) for i in range(torch.cuda.device_count())]
    return facts


def _torch_device(index: int) -> TorchDevice:
    try:
        props = torch.cuda.get_device_properties(index)
    except Exception:  # a GPU CUDA lists but cannot describe: still cuda:index
        return TorchDevice(index, None, None, None)
    uuid = getattr(props, "uuid", None)
    return TorchDevice(index, props.name, bare_uuid(str(uuid)) if uuid else None, props.total_memory / 2**20)


def _cuda_warning(caught: list[warnings.WarningMessage]) -> str | None:
    """CUDA's reason from the warnings is_available() gave, as one line; None when it gave none."""
    texts = [str(w.message).strip() for w in caught if str(w.message).strip()]
    if not texts:
        return None
    text = next((t for t in texts if "CUDA" in t), texts[0])
    # Drop torch's "(Triggered internally at /path/file.cpp:123.)" and keep one line.
    text = re.sub(r"\s*\(Triggered internally at .*", "", text, flags=re.S)
    return " ".join(text.split())


def bare_uuid(uuid: str) -> str:
    """'GPU-0db0…' / 'MIG-0db0…' / '0db0…' -> '0db0…': the form torch and NVML can compare."""
    uuid = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if uuid.startswith(prefix):
            return uuid[len(prefix):]
    return uuid


# ----------------------------------------------------------------------------- NVML


def read_nvml() -> NvmlFacts:
    """Every NVIDIA GPU NVML knows, in NVML order. An NVML error never escapes: it becomes text."""
    pynvml, kind, why = start_nvml()
    if pynvml is None:
        return NvmlFacts(kind, why)
    try:
        return _read_initialised(pynvml)
    finally:
        stop_nvml(pynvml)


def _read_initialised(nv) -> NvmlFacts:
    facts = NvmlFacts()
    system = Queries(nv)
    facts.driver = system.query("driver version", lambda: as_str(nv.nvmlSystemGetDriverVersion()))
    v = system.query("driver's CUDA version", lambda: nv.nvmlSystemGetCudaDriverVersion())
    if v:
        facts.cuda_driver = (v // 1000, (v % 1000) // 10)  # 13000 -> (13, 0), 12040 -> (12, 4)
    count = system.query("GPU count", lambda: nv.nvmlDeviceGetCount())
    facts.problems = [f"cannot read the {what}: {text}" for what, text in system.problems.items()]
    if "GPU count" in system.problems:
        facts.unavailable, facts.why = "error", facts.problems.pop()
        return facts
    facts.gpus = [_read_gpu(nv, i) for i in range(count or 0)]
    return facts


def _read_gpu(nv, index: int) -> Gpu:
    """One GPU's fields; a field it lacks is None, and `error` says the first real failure."""
    gpu = Gpu(nvml_index=index)
    q = Queries(nv)
    handle = q.query("handle", lambda: nv.nvmlDeviceGetHandleByIndex(index))
    if handle is not None:
        gpu.name = q.query("name", lambda: as_str(nv.nvmlDeviceGetName(handle)))
        gpu.uuid = q.query("uuid", lambda: as_str(nv.nvmlDeviceGetUUID(handle)))
        memory = q.query("memory", lambda: nv.nvmlDeviceGetMemoryInfo(handle))
        if memory is not None:
            gpu.memory_used_mib, gpu.memory_total_mib = memory.used / 2**20, memory.total / 2**20
        gpu.utilization_pct = q.query("utilization", lambda: nv.nvmlDeviceGetUtilizationRates(handle).gpu)
        gpu.temperature_c = q.query("temperature", lambda: nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU))
        gpu.power_w = _per_1000(q.query("power", lambda: nv.nvmlDeviceGetPowerUsage(handle)))
        gpu.power_limit_w = _per_1000(q.query("power limit", lambda: nv.nvmlDeviceGetEnforcedPowerLimit(handle)))
        instances = mig_instance_handles(q, handle)
        if instances is not None:
            gpu.mig_enabled = True
            gpu.mig_instances = [_read_mig_instance(q, h) for h in instances]
    gpu.error = q.problem
    return gpu


def _read_mig_instance(q: Queries, handle) -> MigInstance:
    """One MIG instance, read through its GPU's queries: its failures are its GPU's problem."""
    nv = q.nv
    memory = q.query("MIG instance memory", lambda: nv.nvmlDeviceGetMemoryInfo(handle))
    return MigInstance(
        uuid=q.query("MIG instance uuid", lambda: as_str(nv.nvmlDeviceGetUUID(handle))),
        name=q.query("MIG instance name", lambda: as_str(nv.nvmlDeviceGetName(handle))),
        memory_total_mib=memory.total / 2**20 if memory is not None else None,
    )


def _per_1000(value):
    return None if value is None else value / 1000  # NVML reports milliwatts


# ----------------------------------------------------------------------------- matching


def match_gpus(nvml: NvmlFacts, torch_facts: TorchFacts) -> list[Gpu]:
    """NVML's GPUs with their `cuda:N` set, in torch's order; then the hidden ones, in NVML's.

    A GPU torch uses but NVML did not list (NVML unavailable, or a UUID NVML could not read)
    is added from torch's own facts, so every `cuda:N` appears once.
    """
    by_uuid: dict[str, Gpu | MigInstance] = {}
    for gpu in nvml.gpus:
        for record in (gpu, *gpu.mig_instances):
            if record.uuid:
                by_uuid[bare_uuid(record.uuid)] = record
    extra = []
    for device in torch_facts.devices:
        record = by_uuid.get(device.uuid) if device.uuid else None
        if record is not None:
            record.cuda_index = device.index
        else:
            extra.append(
                Gpu(nvml_index=None, cuda_index=device.index, name=device.name,
                    uuid=device.uuid, memory_total_mib=device.memory_total_mib)
            )
    gpus = [*nvml.gpus, *extra]
    usable = sorted((g for g in gpus if g.usable), key=lambda g: g.first_cuda_index)
    hidden = [g for g in gpus if not g.usable]
    return usable + hidden


# ----------------------------------------------------------------------------- verdict


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


def notes(gpus: list[Gpu], torch_facts: TorchFacts, visible: str | None) -> list[str]:
    """Informative lines: GPUs hidden from this process, GPUs in MIG mode."""
    lines = []
    known = [g for g in gpus if g.nvml_index is not None]
    hidden = [g for g in known if not g.usable]
    if hidden and torch_facts.devices:
        which = ", ".join(f"GPU {g.nvml_index}" for g in hidden)
        cause = (
            f"by CUDA_VISIBLE_DEVICES='{visible}'" if visible is not None
            else "although CUDA_VISIBLE_DEVICES is not set (a container or scheduler limit, or CUDA cannot open it)"
        )
        lines.append(
            f"{len(hidden)} of {len(known)} GPUs hidden from this process {cause}: {which} (NVML numbers); "
            "torch numbers the GPUs it sees from cuda:0"
        )
    for g in gpus:
        if not g.mig_enabled:
            continue
        if g.mig_instances:
            instances = ", ".join(
                f"{m.uuid} ({m.name})" + (f" = cuda:{m.cuda_index}" if m.cuda_index is not None else "")
                for m in g.mig_instances
            )
            lines.append(
                f"GPU {g.nvml_index} is in MIG mode: torch sees its MIG instances, not the whole GPU; "
                f"choose one with CUDA_VISIBLE_DEVICES=MIG-<uuid>. Instances: {instances}"
            )
        else:
            lines.append(
                f"GPU {g.nvml_index} is in MIG mode with no MIG instance, so torch cannot use it: create one "
                f"(nvidia-smi mig -cgi <profile> -C) or turn MIG off (nvidia-smi -i {g.nvml_index} -mig 0)"
            )
    return lines


def gpu_problems(gpus: list[Gpu]) -> list[str]:
    """One line per GPU NVML could not fully read: 'GPU 1: NVML error: GPU is lost'."""
    return [f"{g.label()}: {g.error}" for g in gpus if g.error]
