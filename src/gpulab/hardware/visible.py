"""Which GPUs this process may use: CUDA_VISIBLE_DEVICES, read the way CUDA reads it.

The one reader, for `gpulab devices` (why torch sees no GPU) and the profiler's sampler (which
GPUs to sample). Torch-free, and NVML-free: it is given the GPUs' UUIDs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Selected:
    """A GPU an entry of CUDA_VISIBLE_DEVICES names: NVML's index of the physical GPU, and the
    UUID of the MIG instance when the entry names one of its instances."""

    nvml_index: int
    mig_uuid: str | None = None


def cuda_visible_devices() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def parse_cuda_visible_devices(
    value: str | None, gpu_uuids: Sequence[str | None], mig_uuids: Sequence[Sequence[str | None]] = ()
) -> list[Selected]:
    """The GPUs `value` selects, in its order. `gpu_uuids[i]` is the UUID of NVML's GPU i ('GPU-…',
    None when unreadable); `mig_uuids[i]` those of its MIG instances ('MIG-…'). None selects every GPU.

    Entries are indices or unique prefixes of 'GPU-…'/'MIG-…' UUIDs; CUDA stops at the first entry
    that names nothing (unknown or ambiguous), and a repeated entry hides every GPU. Indices are
    only checked against the count: CUDA numbers GPUs fastest-first unless
    CUDA_DEVICE_ORDER=PCI_BUS_ID, so index i need not be NVML's GPU i.
    """
    if value is None:
        return [Selected(i) for i in range(len(gpu_uuids))]
    named = [(uuid, Selected(i)) for i, uuid in enumerate(gpu_uuids) if uuid]
    named += [(uuid, Selected(i, uuid)) for i, uuids in enumerate(mig_uuids) for uuid in uuids if uuid]
    chosen: list[Selected] = []
    seen: set[str] = set()
    for entry in (e.strip() for e in value.split(",")):
        if entry in seen:
            return []
        seen.add(entry)
        number = re.match(r"[+-]?\d+", entry)
        if number:
            i = int(number.group())
            if not 0 <= i < len(gpu_uuids):
                break
            chosen.append(Selected(i))
        elif entry.upper().startswith(("GPU-", "MIG-")):
            matches = [s for uuid, s in named if uuid.lower().startswith(entry.lower())]
            if len(matches) != 1:
                break  # unknown or ambiguous
            chosen.append(matches[0])
        else:
            break
    return chosen
