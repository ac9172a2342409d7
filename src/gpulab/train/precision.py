"""How a step computes: bf16 autocast or fp32, channels_last or not, compiled or not (auto: what
was measured faster)."""

from __future__ import annotations

import torch

from gpulab.config import TrainConfig
from gpulab.devices import native_bf16
from gpulab.errors import UserError

# auto's choice for --compile (compile_mode says why)
AUTO_COMPILE = "off"


def use_channels_last(cfg: TrainConfig, devices: list[torch.device]) -> bool:
    """NHWC activations where measured faster: on the CPU (oneDNN's convolutions), not on CUDA in
    fp32, where the gain is not established (docs/benchmarks.md, "Where the defaults come from")."""
    if cfg.channels_last == "auto":
        # FSDP2 shards contiguous parameters only: a sharded model keeps NCHW weights
        return all(d.type == "cpu" for d in devices) and cfg.shard != "fsdp"
    return cfg.channels_last == "on"


def autocast_dtype(cfg: TrainConfig, devices: list[torch.device]) -> torch.dtype | None:
    """bf16 mixed precision, or None for plain fp32.

    auto: bf16 on CPUs whose oneDNN has native bf16 (AVX512-BF16, AMX), where LeNet trained
    faster than in fp32 at the same accuracy; emulated bf16 is ~3x slower, so fp32 elsewhere. On
    CUDA, bf16 where the step is replayed as a CUDA graph (--compile graphs) on GPUs with bf16:
    a graph launches autocast's casts for free. Eager on CUDA stays fp32: each cast is another
    launch in a step that waits on launches. The measurements: docs/benchmarks.md, "Where the
    defaults come from"."""
    if cfg.precision != "auto":
        return torch.bfloat16 if cfg.precision == "bf16" else None
    if all(d.type == "cpu" for d in devices):
        return torch.bfloat16 if native_bf16(devices[0]) else None
    recorded = all(d.type == "cuda" for d in devices) and compile_mode(cfg, devices) == "graphs"
    return torch.bfloat16 if recorded and all(native_bf16(d) for d in devices) else None


def compile_mode(cfg: TrainConfig, devices: list[torch.device]) -> str:
    """off, on or graphs (the Trainer's Forward): --compile, with auto's choice resolved.

    auto: off, where measured, on the CPU and on CUDA alike: compiled, LeNet's epochs ran at most
    a few percent faster on the CPU, and on a GPU the whole step replayed as a CUDA graph trained
    6x faster per epoch - yet a 10-epoch run took longer as a whole, compiling (seconds with a
    warm cache, 7-20 s with an empty one) and torch.compile's start-up costing more than the
    epochs won (docs/benchmarks.md, "Where the defaults come from"). A recorded step must also
    never read the host, which a user's model may do in its forward. A long run, or one that is
    repeated, should ask for --compile graphs."""
    if cfg.compile == "auto":
        return AUTO_COMPILE
    if cfg.compile == "graphs" and not all(d.type == "cuda" for d in devices):
        raise UserError("--compile graphs replays the step as CUDA graphs: it needs --devices cuda...; "
                        "on a CPU use --compile on")
    if cfg.compile != "off" and cfg.sync_bn and len(devices) > 1:
        raise UserError("--compile with --sync-bn over several devices in one process: its replicas run in "
                        "threads that meet inside forward, which torch.compile does not trace; drop one (or use "
                        "torchrun ranks: gpulab launch)")
    return cfg.compile
