"""An out-of-memory error, read where it happened: how much was asked for, on which device, in
which phase (forward of which module, backward, the optimizer's step, loading data), and what
was in use by category at that moment.

Read from the exception and its traceback, which still holds the failing step's frames: the
tensors in their locals, and the autograd graph behind them (each node's saved tensors, as
autograd exposes them: `node._saved_*`), are the step's activations at that moment.
"""

from __future__ import annotations

import re
import traceback
import types

import torch

from gpulab.memory.records import OutOfMemory
from gpulab.memory.tensors import (Storages, frame_locals, gradients, optimizer_state, parameters_and_buffers, reachable_from,
                                   script_roots, tensors_in)

_CPU_OOM = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")
_CUDA_OOM = re.compile(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_CUDA_DEVICE = re.compile(r"GPU (\d+) has a total capacity of ([\d.]+) (B|KiB|MiB|GiB|TiB)")
_CUDA_LIMIT = re.compile(r"([\d.]+) (B|KiB|MiB|GiB|TiB) allowed")
_CUDA_PROCESS = re.compile(r"this process has ([\d.]+) (B|KiB|MiB|GiB|TiB) memory in use")
_MAX_GRAPH_NODES = 100_000


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, the CPU allocator's "can't allocate memory", or Python's MemoryError."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


def _bytes(pattern: re.Pattern, message: str) -> int | None:
    m = pattern.search(message)
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None


def requested_bytes(message: str) -> int | None:
    if m := _CPU_OOM.search(message):
        return int(m.group(1))
    if m := _CUDA_OOM.search(message):
        return int(float(m.group(1)) * _UNITS[m.group(2)])
    return None


def read_out_of_memory(error: BaseException, tb: types.TracebackType | None, modules: list[torch.nn.Module],
                       optimizers: list[torch.optim.Optimizer], user_site) -> OutOfMemory:
    """What the out-of-memory `error` (raised through `tb`) met. `modules`, `optimizers`: what the
    loop was training; `user_site(frame)`: the user's file:line at or above a frame."""
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    frames = [frame for frame, _ in traceback.walk_tb(tb)]
    device = _device_of(error, modules)
    names = {id(m): (name or type(root).__name__) for root in modules for name, m in root.named_modules()}
    module, phase = _phase(frames, names)
    oom: OutOfMemory = {"device": str(device), "requested": requested_bytes(str(error)), "message": message,
                        "where": user_site(frames[-1]) if frames else None, "module": module, "phase": phase,
                        "in_use": {}, "total_in_use": 0, "device_total": None, "limit": None, "process_total": None,
                        "reserved": None, "batch": None, "dtype": None}
    _count_in_use(oom, device, frames, modules, optimizers)
    if device.type == "cuda":
        oom["reserved"] = torch.cuda.memory_reserved(device)
        oom["device_total"] = torch.cuda.get_device_properties(device).total_memory
        # The allocator's own words: "2.00 GiB allowed" when set_per_process_memory_fraction capped
        # it, and all this process holds on the device (its CUDA context and libraries included).
        oom["limit"] = _bytes(_CUDA_LIMIT, str(error))
        oom["process_total"] = _bytes(_CUDA_PROCESS, str(error))
    return oom


def _device_of(error: BaseException, modules: list[torch.nn.Module]) -> torch.device:
    if isinstance(error, torch.OutOfMemoryError):
        m = _CUDA_DEVICE.search(str(error))
        return torch.device("cuda", int(m.group(1))) if m else torch.device("cuda", torch.cuda.current_device())
    if not isinstance(error, MemoryError) and "can't allocate memory" in str(error):
        return torch.device("cpu")
    for module in modules:
        for p in module.parameters():
            return p.device
    return torch.device("cpu")


def _phase(frames: list[types.FrameType], names: dict[int, str]) -> tuple[str | None, str]:
    """(module, phase) from the innermost frame that says what the step was doing."""
    for frame in reversed(frames):
        owner = frame_locals(frame).get("self")
        code = frame.f_code
        if isinstance(owner, torch.nn.Module) and code.co_name in ("forward", "_call_impl", "_wrapped_call_impl"):
            name = names.get(id(owner))
            module = f"{name} ({type(owner).__name__})" if name else type(owner).__name__
            return module, f"forward of {module}"
        if isinstance(owner, torch.optim.Optimizer):
            return None, f"optimizer step ({type(owner).__name__})"
        if _runs_backward(frame):
            return None, "backward"
        if isinstance(owner, torch.utils.data.dataloader._BaseDataLoaderIter):
            return None, "loading data"
    return None, "outside forward, backward and the optimizer"


def _runs_backward(frame: types.FrameType) -> bool:
    code = frame.f_code
    return code.co_name in ("backward", "grad", "_engine_run_backward") and "torch" in code.co_filename


def _count_in_use(oom: OutOfMemory, device: torch.device, frames, modules, optimizers) -> None:
    params = Storages(device).add_all(parameters_and_buffers(modules))
    grads = Storages(device).add_all(g for g in gradients(modules, optimizers) if g not in params)
    opt = Storages(device).add_all(t for t in optimizer_state(optimizers) if t not in params)
    kept = [params, grads, opt]
    inputs, activations, dtypes = Storages(device), Storages(device), []
    # Frames inside backward (a tensor hook, a custom Function's backward) hold the gradients
    # flowing through it - no batch, no activation: they count as "other".
    backward = next((i for i, frame in enumerate(frames) if _runs_backward(frame)), len(frames))
    local = [t for frame in frames[:backward + 1] for value in frame_locals(frame).values() for t in tensors_in(value)]
    for t in local:
        if any(t in k for k in kept):
            continue
        if t.grad_fn is None and not t.requires_grad:
            if inputs.add(t) and oom["batch"] is None and t.dim():
                oom["batch"] = t.shape[0]  # what the step was given (the batch), not made by it
        elif activations.add(t):
            dtypes.append(t.dtype)
    for saved in _saved_in_graph([t for t in local if t.grad_fn is not None]):
        if not any(saved in k for k in (*kept, inputs)) and activations.add(saved):
            dtypes.append(saved.dtype)
    if device.type == "cuda":
        total = torch.cuda.memory_allocated(device)
    else:  # what the script reaches from the failing frame up, and what only the graph holds
        live = reachable_from(script_roots(frames[-1]) if frames else [], device)
        total = live.nbytes + sum(n for key, n in activations.bytes_by_key.items() if key not in live.bytes_by_key)
    in_use = {"parameters": params.nbytes, "gradients": grads.nbytes, "optimizer_state": opt.nbytes,
              "activations": activations.nbytes, "inputs": inputs.nbytes}
    in_use["other"] = max(0, total - sum(in_use.values()))
    oom["in_use"], oom["total_in_use"] = in_use, max(total, sum(in_use.values()))
    oom["dtype"] = str(max(set(dtypes), key=dtypes.count)).removeprefix("torch.") if dtypes else None


def _saved_in_graph(roots: list[torch.Tensor]):
    """The tensors the autograd graph behind `roots` still holds for backward."""
    seen: set[int] = set()
    stack = [t.grad_fn for t in roots]
    while stack and len(seen) < _MAX_GRAPH_NODES:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                value = getattr(node, attr)
            except RuntimeError:  # freed already (its backward ran)
                continue
            yield from tensors_in(value)
        stack.extend(next_node for next_node, _ in node.next_functions)
