"""What NVML says about this machine, as `gpulab devices` reports it: the driver, and one record per
GPU in NVML's order (`Gpu`, with its MIG instances). torch's numbers (`cuda:N`) are filled in by
matching.py.

NVML (nvidia-ml-py) lists every NVIDIA GPU the driver knows, with the driver's version and the
newest CUDA it supports. It may be missing, refuse us, or fail on one GPU (lost, no permission):
read through nvml_gpus.py and the one funnel, each failure is n/a and, when it is a problem, a
line of text, never a traceback. Torch-free.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from gpulab.hardware.nvml import Queries, start_nvml, stop_nvml
from gpulab.hardware.nvml_gpus import NvmlGpu, list_gpus, read_driver

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


# ----------------------------------------------------------------------------- reading


def read_nvml() -> NvmlFacts:
    """Every NVIDIA GPU NVML knows, in NVML order. An NVML error never escapes: it becomes text."""
    pynvml, kind, why = start_nvml()
    if pynvml is None:
        return NvmlFacts(kind, why)
    try:
        return _read_started(pynvml)
    finally:
        stop_nvml(pynvml)


def _read_started(nv) -> NvmlFacts:
    facts = NvmlFacts()
    system = Queries(nv)
    facts.driver, facts.cuda_driver = read_driver(system)
    found = list_gpus(system)
    facts.problems = [f"cannot read the {what}: {text}" for what, text in system.problems.items()]
    if "GPU count" in system.problems:
        facts.unavailable, facts.why = "error", facts.problems.pop()
        return facts
    facts.gpus = [_gpu_record(gpu) for gpu in found]
    return facts


def _gpu_record(gpu: NvmlGpu) -> Gpu:
    """One GPU's fields; a field it lacks is None, and `error` says the first real failure."""
    record = Gpu(nvml_index=gpu.index)
    if gpu.handle is not None:
        record.name, record.uuid, record.memory_total_mib = gpu.name, gpu.uuid, gpu.memory_total_mib
        # Its readings go through the GPU's own queries: its facts' and readings' failures are one
        # list, in the order they happened, and the first is the one the report says.
        q = gpu.queries
        record.memory_used_mib = q.query("memory", gpu.memory_used_mib)
        record.utilization_pct = q.query("utilization", lambda: gpu.utilization_pct()[0])
        record.temperature_c = q.query("temperature", gpu.temperature_c)
        record.power_w = q.query("power", gpu.power_w)
        record.power_limit_w = q.query("power limit", gpu.power_limit_w)
        if gpu.mig_instances is not None:
            record.mig_enabled = True
            record.mig_instances = [MigInstance(m.uuid, m.name, m.memory_total_mib) for m in gpu.mig_instances]
    record.error = gpu.queries.problem
    return record


def gpu_problems(gpus: list[Gpu]) -> list[str]:
    """One line per GPU NVML could not fully read: 'GPU 1: NVML error: GPU is lost'."""
    return [f"{g.label()}: {g.error}" for g in gpus if g.error]
