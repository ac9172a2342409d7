"""The command-line options that say what one training step is: gpulab train and gpulab plan
both take them (argparse only; TrainConfig validates the values)."""

from __future__ import annotations

_STEP_FIELDS = ("model", "data_dir", "devices", "batch_size", "recipe", "sync", "channels_last", "precision")


def add_step_options(p) -> None:
    """What one training step is: the options gpulab train and gpulab plan share."""
    p.add_argument("--model", default=None, help="lenet (default), resnet18, or your own: package.module:factory (a callable returning an nn.Module that takes 1x28x28 images and gives 10 class scores)")
    p.add_argument("--data-dir", default=None, help="folder with the IDX files (default: $GPULAB_DATA, cache, Debian's path)")
    p.add_argument("--devices", default=None, help="auto or all (default: every GPU, else the CPU) | cpu | cpu*K | cuda:0,cuda:1 | gpu:N")
    p.add_argument(
        "--batch-size", type=int, default=None,
        help="GLOBAL minibatch size (default 256): with k devices each device gets about batch-size/k",
    )
    p.add_argument("--recipe", default=None, help="modern (default) or textbook (SGD, lr 0.2)")
    p.add_argument(
        "--sync", default=None,
        help="under torchrun: gpulab (default: bucketed all-reduce overlapped with backward) or ddp (PyTorch's DDP)",
    )
    p.add_argument("--channels-last", default=None, help="auto (default: on for CPU), on or off")
    p.add_argument("--precision", default=None, help="auto (default: bf16 autocast on CPUs with native bf16), fp32 or bf16")


def step_options(args) -> dict:
    """The step options the user gave (None: not given)."""
    return {f: getattr(args, f) for f in _STEP_FIELDS if getattr(args, f) is not None}
