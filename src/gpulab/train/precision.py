"""How a step computes: bf16 autocast or fp32, channels_last or not, compiled or not (auto: what
was measured faster)."""

from __future__ import annotations

import torch

from gpulab.config import TrainConfig
from gpulab.devices import native_bf16
from gpulab.errors import UserError

# auto's choice for --compile, from the measurements in compile_mode's docstring
AUTO_COMPILE = "off"


def use_channels_last(cfg: TrainConfig, devices: list[torch.device]) -> bool:
    # On CPU, oneDNN's LeNet convolutions ran 1.5x and 2.2x faster on NHWC than NCHW in two runs
    # of benchmarks/train_speed.py; on CUDA with fp32 the gain is not established, so auto = off.
    if cfg.channels_last == "auto":
        # FSDP2 shards contiguous parameters only: a sharded model keeps NCHW weights
        return all(d.type == "cpu" for d in devices) and cfg.shard != "fsdp"
    return cfg.channels_last == "on"


def autocast_dtype(cfg: TrainConfig, devices: list[torch.device]) -> torch.dtype | None:
    """bf16 mixed precision, or None for plain fp32.

    auto: bf16 on CPUs whose oneDNN has native bf16 (AVX512-BF16/AMX): there LeNet trained 1.3x
    and 1.9x faster than fp32 channels_last in two runs of benchmarks/train_speed.py, at the
    same accuracy (10 epochs: 0.906 vs 0.908).

    On CUDA, bf16 where the step is replayed as a CUDA graph (--compile graphs) on GPUs with bf16
    (Ampere and later): a graph launches autocast's casts for free, and LeNet's recorded step took
    0.097 s per epoch in bf16 against 0.123 s in fp32, test accuracy 0.884 after 3 epochs both
    (one H200, benchmarks/graphs_variants.py, one round; benchmarks/results/h200-2026-11-27-issue35).
    Eager on CUDA stays fp32: each cast is another launch in a step that waits on launches
    (unmeasured there)."""
    if cfg.precision != "auto":
        return torch.bfloat16 if cfg.precision == "bf16" else None
    if all(d.type == "cpu" for d in devices):
        return torch.bfloat16 if native_bf16(devices[0]) else None
    recorded = all(d.type == "cuda" for d in devices) and compile_mode(cfg, devices) == "graphs"
    return torch.bfloat16 if recorded and all(native_bf16(d) for d in devices) else None


def compile_mode(cfg: TrainConfig, devices: list[torch.device]) -> str:
    """off, on or graphs (the Trainer's Forward): --compile, with auto's choice resolved.

    auto: off, where measured. LeNet on this project's 2-core Zen 4 EPYC (native bf16; 2026-11-27,
    two epochs per setting, benchmarks/results/cpu-amd-epyc-2core/compile_speed.txt): compiled,
    an epoch took 5.08 s against 5.35 s eager in bf16 (batch 256), 4.92 against 5.33 at batch 512,
    and in fp32 8.31 against 8.26 (256), 7.57 against 8.00 (512), for 5-20 s of compiling with a
    cold cache - 0-8% that a run must win back first (oneDNN's convolutions are 60% of the step
    either way, and compiled, their backward ran slower: torch.profiler, 12.5 against 10.2 ms).
    (A NaN, then an index out of bounds, once seen with ATEN_CPU_CAPABILITY=avx2 came from
    inductor's on-disk cache, shared between that and the native instruction set on one machine:
    with a cache of its own the compiled step trains there as the eager one does - tests/train/test_compile.py
    passed so.) On CUDA, off too: on one H200 side by side (gpulab bench training, 10 epochs x 3
    rounds, 2026-11-27, benchmarks/results/h200-2026-11-27-issue35) LeNet's epoch of training took
    0.748 s eager, 0.716 s with --compile on and 0.125 s with --compile graphs (the whole step
    recorded; the textbook 1.181 s, its evaluation included), but the whole process of 10 epochs
    took longer compiled - 18.2 s eager, 23.1 s on, 20.7 s graphs - for 1.3 s of compiling from a
    warm cache (7-13 s cold), torch.compile's own start-up and the recording: a short run loses
    what the epochs win.
    And a recorded step must never read the host, which a user's model may do in its forward. A
    long run, or one that is repeated, should ask for --compile graphs."""
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
