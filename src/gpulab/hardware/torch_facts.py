"""What torch says: which build it is (CUDA x.y, ROCm, or CPU-only) and which GPUs *it* can use,
in its own order: `cuda:N` after CUDA_VISIBLE_DEVICES. A CPU-only build is never asked about CUDA,
and a CUDA that fails to start is its reason in words, never a traceback.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field

import torch


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
    """'GPU-0db0…' / 'MIG-0db0…' / '0db0…' -> '0db0…': the form torch prints, and the one torch's
    and NVML's UUIDs are compared in."""
    uuid = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if uuid.startswith(prefix):
            return uuid[len(prefix):]
    return uuid
