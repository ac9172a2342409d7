"""NVML's GPUs matched to torch's: the report numbers GPUs as `cuda:N` means them.

They are matched by UUID (NVML writes 'GPU-<uuid>' or 'MIG-<uuid>', torch the bare '<uuid>');
what matches nothing of torch's is hidden from this process (CUDA_VISIBLE_DEVICES, a container),
and a GPU in MIG mode is used through its instances. The notes say both.
"""

from __future__ import annotations

from gpulab.hardware.nvml_facts import Gpu, MigInstance, NvmlFacts
from gpulab.hardware.torch_facts import TorchFacts, bare_uuid


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


def notes(gpus: list[Gpu], torch_facts: TorchFacts, visible: str | None) -> list[str]:
    """Informative lines: GPUs hidden from this process, GPUs in MIG mode."""
    return [*_hidden_note(gpus, torch_facts, visible), *(_mig_note(g) for g in gpus if g.mig_enabled)]


def _hidden_note(gpus: list[Gpu], torch_facts: TorchFacts, visible: str | None) -> list[str]:
    known = [g for g in gpus if g.nvml_index is not None]
    hidden = [g for g in known if not g.usable]
    if not (hidden and torch_facts.devices):
        return []
    which = ", ".join(f"GPU {g.nvml_index}" for g in hidden)
    cause = (
        f"by CUDA_VISIBLE_DEVICES='{visible}'" if visible is not None
        else "although CUDA_VISIBLE_DEVICES is not set (a container or scheduler limit, or CUDA cannot open it)"
    )
    return [
        f"{len(hidden)} of {len(known)} GPUs hidden from this process {cause}: {which} (NVML numbers); "
        "torch numbers the GPUs it sees from cuda:0"
    ]


def _mig_note(g: Gpu) -> str:
    if not g.mig_instances:
        return (
            f"GPU {g.nvml_index} is in MIG mode with no MIG instance, so torch cannot use it: create one "
            f"(nvidia-smi mig -cgi <profile> -C) or turn MIG off (nvidia-smi -i {g.nvml_index} -mig 0)"
        )
    instances = ", ".join(
        f"{m.uuid} ({m.name})" + (f" = cuda:{m.cuda_index}" if m.cuda_index is not None else "")
        for m in g.mig_instances
    )
    return (
        f"GPU {g.nvml_index} is in MIG mode: torch sees its MIG instances, not the whole GPU; "
        f"choose one with CUDA_VISIBLE_DEVICES=MIG-<uuid>. Instances: {instances}"
    )
