"""How a step computes: bf16 autocast or fp32, channels_last or not, compiled, recorded as a CUDA
graph or eager (auto: what was measured faster)."""

from __future__ import annotations

import torch

from gpulab.config import TrainConfig
from gpulab.devices import native_bf16
from gpulab.errors import UserError
from gpulab.models import MODELS


def use_channels_last(cfg: TrainConfig, devices: list[torch.device]) -> bool:
    """NHWC activations where measured faster: on the CPU (oneDNN's convolutions), not on CUDA in
    fp32, where the gain is not established (docs/benchmarks.md, "Where the defaults come from")."""
    if cfg.channels_last == "auto":
        # FSDP2 shards contiguous parameters only: a sharded model keeps NCHW weights
        return all(d.type == "cpu" for d in devices) and cfg.shard != "fsdp"
    return cfg.channels_last == "on"


def autocast_dtype(cfg: TrainConfig, devices: list[torch.device], compile: str) -> torch.dtype | None:
    """bf16 mixed precision, or None for plain fp32; `compile`: compile_mode's answer.

    auto: bf16 on CPUs whose oneDNN has native bf16 (AVX512-BF16, AMX), where LeNet trained
    faster than in fp32 at the same accuracy; emulated bf16 is ~3x slower, so fp32 elsewhere. On
    CUDA, bf16 where the step is replayed as a CUDA graph (record, graphs) on GPUs with bf16: a
    graph launches autocast's casts for free. Eager on CUDA stays fp32: each cast is another
    launch in a step that waits on launches. The measurements: docs/benchmarks.md, "Where the
    defaults come from"."""
    if cfg.precision != "auto":
        return torch.bfloat16 if cfg.precision == "bf16" else None
    if all(d.type == "cpu" for d in devices):
        return torch.bfloat16 if native_bf16(devices[0]) else None
    recorded = all(d.type == "cuda" for d in devices) and compile in ("record", "graphs")
    return torch.bfloat16 if recorded and all(native_bf16(d) for d in devices) else None


def compile_mode(cfg: TrainConfig, devices: list[torch.device], processes: int = 1, own_parts: bool = False) -> str:
    """off, on, graphs or record (the Trainer's step): --compile, with auto's choice resolved.
    `processes`: the job's; `own_parts`: the caller gave its own model, loss or optimizer.

    auto: on one GPU, record - the eager step recorded once as a CUDA graph and replayed: three
    eager warm-up steps and one recording, nothing to compile - for gpulab's own models, loss and
    optimizer, whose steps never read the host (a user's model may, in its forward, which no
    recording can hold); off everywhere else. Measured: on a GPU a LeNet epoch replayed as one
    graph took 0.11 s where the eager step's took 0.87 s; torch.compile (on, graphs) made the
    epochs faster too, on the CPU by at most a few percent, but a 10-epoch process took longer
    as a whole, compiling (seconds with a warm cache, 7-20 s with an empty one) and torch.compile's
    start-up costing more than the epochs won (docs/benchmarks.md, "Where the defaults come
    from"). A long or repeated run may ask for --compile graphs."""
    one_gpu = len(devices) == 1 and devices[0].type == "cuda" and processes == 1
    if cfg.compile == "auto":
        records = one_gpu and cfg.accumulate == 1 and cfg.model in MODELS and not own_parts
        return "record" if records else "off"
    if cfg.compile in ("graphs", "record") and not all(d.type == "cuda" for d in devices):
        raise UserError(f"--compile {cfg.compile} replays the step as CUDA graphs: it needs --devices cuda...; "
                        "on a CPU use --compile on")
    if cfg.compile == "record" and not (one_gpu and cfg.accumulate == 1):
        raise UserError("--compile record records one GPU's whole step, in one process, one micro-batch: for several "
                        "devices, processes or --accumulate use --compile graphs")
    if cfg.compile != "off" and cfg.sync_bn and len(devices) > 1:
        raise UserError("--compile with --sync-bn over several devices in one process: its replicas run in "
                        "threads that meet inside forward, which torch.compile does not trace; drop one (or use "
                        "torchrun ranks: gpulab launch)")
    return cfg.compile
