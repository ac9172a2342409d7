"""How a step computes: bf16 autocast or fp32, channels_last or not (auto: what was measured faster)."""

from __future__ import annotations

import torch

from gpulab.config import TrainConfig


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
    same accuracy (10 epochs: 0.906 vs 0.908). On CUDA auto stays fp32 until a GPU measurement says otherwise.
    """
    if cfg.precision == "auto":
        on_cpu = all(d.type == "cpu" for d in devices)
        native_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        return torch.bfloat16 if on_cpu and native_bf16 else None
    return torch.bfloat16 if cfg.precision == "bf16" else None
