"""Devices: naming them, finding them, and moving data between them.

The rules follow the textbook chapter on GPUs:
- every tensor lives on one device, and an operation needs all its inputs on the same one;
- `place(x, d)` is free when `x` already lives on `d` (it returns `x` itself);
- `copy_to(x, d)` always makes a new copy, even on the same device;
- moving data is slow, so gpulab only ever moves it on purpose.

`resolve("cpu*4")` gives four *virtual* replicas of the CPU: the same physical device four
times, so data-parallel logic can be exercised and tested on a machine without GPUs.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from gpulab.errors import UserError

# ----------------------------------------------------------------------------- naming


def cpu() -> torch.device:
    return torch.device("cpu")


def gpu(i: int = 0) -> torch.device:
    return torch.device("cuda", _gpu_index(i))


def num_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def try_gpu(i: int = 0) -> torch.device:
    """GPU `i` if it exists, else the CPU."""
    return gpu(i) if _gpu_index(i) < num_gpus() else cpu()


def _gpu_index(i) -> int:
    """A GPU's index: a whole number from 0 (not a string, a bool or a float)."""
    if isinstance(i, bool) or not isinstance(i, int):
        raise TypeError(f"a GPU index is a whole number from 0, not {i!r} ({type(i).__name__})")
    if i < 0:
        raise ValueError(f"a GPU index is a whole number from 0, not {i}")
    return i


def try_all_gpus() -> list[torch.device]:
    """Every GPU, or `[cpu()]` when there is none (never an empty list)."""
    return [gpu(i) for i in range(num_gpus())] or [cpu()]


def native_bf16(device: torch.device) -> bool:
    """Does `device` compute bf16 in hardware? A CPU needs oneDNN's bf16 (AVX512-BF16 or AMX):
    with AVX2 only torch emulates it (a 2048 matmul: 0.4 GFLOP/s against 185 in fp32, on a Zen 4
    held to AVX2)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def describe_available() -> str:
    gpus = [f"cuda:{i}" for i in range(num_gpus())]
    return ", ".join(["cpu", *gpus]) + ("" if gpus else " (no CUDA GPU visible to torch)")


_VIRTUAL = re.compile(r"^cpu\*(\d+)$")
_GPU = re.compile(r"^(?:cuda|gpu)(?::(\d+))?$")
MAX_VIRTUAL_REPLICAS = 64
"""The most replicas `cpu*K` makes. Virtual replicas rehearse a machine's GPUs, and machines hold 8
or 16; each replica is a whole copy of the model, its gradients and its optimizer state in this one
process, so thousands would exhaust memory rather than rehearse anything."""


def _parse_one(token: str) -> torch.device:
    if token in ("cpu", "cpu:0"):
        return cpu()
    m = _GPU.match(token)
    if not m:
        raise UserError(
            f"unknown device '{token}': use auto, all, cpu, cpu*K, cuda, cuda:N or gpu:N "
            f"(available: {describe_available()})"
        )
    index = int(m.group(1) or 0)
    if index >= num_gpus():
        raise UserError(f"device '{token}' is not available here; available: {describe_available()}")
    return gpu(index)


def virtual_replica_count(spec: str, digits: str) -> int:
    """K of `cpu*K`, from 1 to MAX_VIRTUAL_REPLICAS, or a one-line error."""
    significant = digits.lstrip("0") or "0"
    # Judged by its length first: int() refuses more than 4300 digits, and a list that long overflows.
    k = int(significant) if len(significant) <= len(str(MAX_VIRTUAL_REPLICAS)) else None
    if k is None or not 1 <= k <= MAX_VIRTUAL_REPLICAS:
        raise UserError(
            f"device spec '{spec}' asks for {significant} virtual replicas: use cpu*K with K >= 1 and at most "
            f"{MAX_VIRTUAL_REPLICAS} (each replica is a whole copy of the model in this one process)"
        )
    return k


def _canonical(spec: str) -> str:
    """A device spec as it is read: lower case, no spaces ("CPU * 2" is cpu*2)."""
    return spec.strip().lower().replace(" ", "")


def resolve(spec: str) -> list[torch.device]:
    """Turn a CLI device spec into a list of devices, one per data-parallel replica.

    auto | all   every GPU, else the CPU
    cpu          the CPU
    cpu*K        K virtual replicas on the CPU (for testing multi-device logic), K <= MAX_VIRTUAL_REPLICAS
    cuda | gpu   the first GPU;  cuda:N | gpu:N  GPU N
    a,b,c        a comma-separated list of the above (real devices may not repeat)
    """
    spec = _canonical(spec)
    if spec in ("auto", "all"):
        return try_all_gpus()
    m = _VIRTUAL.match(spec)
    if m:
        return [cpu()] * virtual_replica_count(spec, m.group(1))
    tokens = [t for t in spec.split(",") if t]
    if not tokens:
        raise UserError("empty device spec: use auto, cpu, cpu*K or cuda:0,cuda:1")
    if any(_VIRTUAL.match(t) for t in tokens):
        raise UserError(f"device spec '{spec}' puts cpu*K in a list: cpu*K stands alone (K replicas on the CPU); a "
                        "list names GPUs, e.g. cuda:0,cuda:1")
    devices = [_parse_one(t) for t in tokens]
    if len({d.type for d in devices}) > 1:
        # A CPU replica would be far slower than the GPUs and every step would wait for it.
        raise UserError(f"device spec '{spec}' mixes the CPU and GPUs: list GPUs only, or use cpu*K")
    if len(set(devices)) != len(devices):
        raise UserError(
            f"device spec '{spec}' lists a device twice: list each GPU once "
            "(use cpu*K for virtual CPU replicas)"
        )
    return devices


def names_several(spec: str) -> bool:
    """Does `spec` name several devices for one process (cpu*K with K > 1, a list)? Read from the
    text alone: no device is looked for."""
    spec = _canonical(spec)
    m = _VIRTUAL.match(spec)
    return bool(m and int(m.group(1)) > 1) or len([t for t in spec.split(",") if t]) > 1


def for_rank(spec: str, local_rank: int, local_world_size: int) -> torch.device:
    """The one device a torchrun rank drives: `cuda:LOCAL_RANK` for auto/cuda with GPUs, else the CPU.

    Under torchrun each process drives exactly one device; more devices means more processes
    (`--nproc-per-node`), so a spec naming several devices is an error here.
    """
    spec = _canonical(spec)
    if spec in ("auto", "all"):
        spec = "cuda" if num_gpus() else "cpu"
    if spec in ("cpu", "cpu:0", "cpu*1"):
        return cpu()
    if spec in ("cuda", "gpu"):
        if local_rank >= num_gpus():
            raise UserError(
                f"local rank {local_rank} needs GPU cuda:{local_rank}, but this machine has {num_gpus()}: "
                f"launch at most {num_gpus()} processes per machine (--nproc-per-node), or use --devices cpu"
            )
        return gpu(local_rank)
    devices = resolve(spec)
    if len(devices) > 1:
        raise UserError(
            f"--devices {spec} names {len(devices)} devices, but under torchrun each process drives one: "
            "use --devices auto (cuda:LOCAL_RANK, else the CPU), cuda or cpu, and launch one process per device"
        )
    if local_world_size > 1:
        raise UserError(
            f"--devices {spec} puts all {local_world_size} processes of this machine on one device: "
            "use --devices auto or cuda (each rank takes cuda:LOCAL_RANK), or cpu"
        )
    return devices[0]


def format_devices(devices: list[torch.device]) -> str:
    """`[cpu*2]` for virtual replicas, `[cuda:0, cuda:1]` otherwise."""
    if len(devices) > 1 and len(set(devices)) == 1:
        return f"[{devices[0]}*{len(devices)}]"
    return "[" + ", ".join(str(d) for d in devices) + "]"


# ----------------------------------------------------------------------------- moving


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cuda":
        # cuda and cuda:0 name the same device when 0 is current
        ia = a.index if a.index is not None else torch.cuda.current_device()
        ib = b.index if b.index is not None else torch.cuda.current_device()
        return ia == ib
    return True


def _map(fn, x: Any, keep_unchanged: bool = False) -> Any:
    """Apply `fn` to every tensor/module in `x`, rebuilding the containers around the results.

    With `keep_unchanged`, a container whose leaves all come back as the very same objects is
    returned itself rather than rebuilt, so `place` on data already in place is `x` itself.
    """
    if isinstance(x, torch.Tensor | torch.nn.Module):
        return fn(x)
    if isinstance(x, Mapping):
        items = {k: _map(fn, v, keep_unchanged) for k, v in x.items()}
        if keep_unchanged and all(items[k] is v for k, v in x.items()):
            return x
        if isinstance(x, dict):  # its own kind, whatever its constructor takes (a defaultdict's factory)
            rebuilt = copy.copy(x)
            rebuilt.update(items)
            return rebuilt
        return type(x)(items)
    if isinstance(x, list | tuple):
        values = [_map(fn, v, keep_unchanged) for v in x]
        if keep_unchanged and all(a is b for a, b in zip(values, x)):
            return x
        if hasattr(x, "_fields"):  # namedtuple
            return type(x)(*values)
        return type(x)(values)
    raise TypeError(f"cannot move a {type(x).__name__}: expected tensors, modules, or lists/dicts of them")


def device_of(x: torch.Tensor | torch.nn.Module) -> torch.device:
    """The one device a tensor or module lives on; a module spread over several is an error."""
    if isinstance(x, torch.Tensor):
        return x.device
    found = {t.device for t in [*x.parameters(), *x.buffers()]}
    if len(found) > 1:
        raise UserError(
            f"module {type(x).__name__} has tensors on several devices "
            f"({', '.join(sorted(map(str, found)))}): move it to one device first"
        )
    return found.pop() if found else cpu()


def place(x: Any, device: torch.device | str) -> Any:
    """Put `x` on `device`; a no-op returning `x` itself when it is already there.

    Works on tensors, modules (moved in place, as `nn.Module.to` does) and nested
    lists/tuples/dicts of them.
    """
    device = torch.device(device)

    def one(t):
        if _same_device(device_of(t), device):
            return t
        return t.to(device)

    return _map(one, x, keep_unchanged=True)


def copy_to(x: Any, device: torch.device | str) -> Any:
    """Always a fresh copy of `x` on `device`, even when `x` already lives there."""
    import copy

    device = torch.device(device)

    def one(t):
        if isinstance(t, torch.Tensor):
            # .to(copy=True) keeps autograd history, like MXNet's copyto inside a graph
            return t.to(device, copy=True)
        return copy.deepcopy(t).to(device)

    return _map(one, x)


def check_same_device(*tensors: torch.Tensor) -> torch.device:
    """The shared device of `tensors`, or a clear error naming where each one lives."""
    found = [t.device for t in tensors]
    first = found[0]
    if any(not _same_device(d, first) for d in found[1:]):
        where = ", ".join(str(d) for d in found)
        raise UserError(
            f"tensors live on different devices ({where}): move them to one device "
            "with gpulab.devices.place(x, device) before combining them"
        )
    return first


# ----------------------------------------------------------------------------- waiting


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait until every CUDA device in `devices` has finished its queued work (CPU: nothing to do)."""
    for d in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(d)
