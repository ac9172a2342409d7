"""LeNet's training step with ReLUAvgPool2d (gpulab's, models/layers.py) against torch's own ReLU
then AvgPool2d, side by side in one process, alternating rounds: the steps gpulab train runs on
this device (its batch, layout, precision; the recipe's SGD; glibc's thresholds fixed as
gpulab fixes them), the same numbers bit for bit.

    PYTHONPATH=src python benchmarks/relu_pool.py [--rounds 5] [--devices cpu] [--out benchmarks/results/<machine>]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gpulab.config import TrainConfig
from gpulab.devices import resolve, synchronize
from gpulab.host import fix_malloc_thresholds
from gpulab.io import git_commit
from gpulab.models import LeNet
from gpulab.train.precision import autocast_dtype, use_channels_last
from gpulab.train.recipe import make_optimizer


class TorchsLayers(nn.Module):
    """LeNet's forward with torch's two layers where LeNet has ReLUAvgPool2d."""

    def __init__(self, net: LeNet):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        net = self.net
        x = F.avg_pool2d(F.relu(net.conv1(x)), 2)
        x = F.avg_pool2d(F.relu(net.conv2(x)), 2)
        return net.fc2(net.relu(net.fc1(torch.flatten(x, 1))))


def stepper(layers: str, device: torch.device, cfg: TrainConfig):
    torch.manual_seed(0)
    net = LeNet().to(device)
    if use_channels_last(cfg, [device]):
        net = net.to(memory_format=torch.channels_last)
    model = net if layers == "gpulab" else TorchsLayers(net)
    opt = make_optimizer(cfg.recipe_spec, 0.05)(net.parameters())
    dtype = autocast_dtype(cfg, [device], "off")
    X = torch.rand(cfg.batch_size, 1, 28, 28, device=device)
    if use_channels_last(cfg, [device]):
        X = X.to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (cfg.batch_size,), device=device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(model(X), y)
        loss.backward()
        opt.step()

    return step, net, dtype


def seconds_per_step(step, device: torch.device, steps: int) -> float:
    for _ in range(5):
        step()
    synchronize([device])
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize([device])
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--devices", default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="folder for relu_pool.json")
    args = parser.parse_args()
    fix_malloc_thresholds()
    device = resolve(args.devices)[0]
    cfg = TrainConfig(devices=args.devices)

    trained = {}
    for layers in ("torch", "gpulab"):  # the same weights after the same steps
        step, net, dtype = stepper(layers, device, cfg)
        for _ in range(3):
            step()
        trained[layers] = net.state_dict()
    identical = all(torch.equal(a, b) for a, b in zip(trained["torch"].values(), trained["gpulab"].values()))

    rows: dict[str, list[float]] = {"torch": [], "gpulab": []}
    for r in range(args.rounds):
        for layers in rows:
            step, _, _ = stepper(layers, device, cfg)
            rows[layers].append(seconds_per_step(step, device, args.steps))
            print(f"round {r + 1}: {layers:6s} {rows[layers][-1] * 1e3:.2f} ms/step", flush=True)
    ratios = [t / g for t, g in zip(rows["torch"], rows["gpulab"])]
    precision = "bf16 autocast" if dtype is not None else "fp32"
    print(f"\nLeNet step on {device}, batch {cfg.batch_size}, {precision}: ms per step, median [min .. max] "
          f"over {args.rounds} rounds")
    for layers, values in rows.items():
        print(f"  {layers:6s} {statistics.median(values) * 1e3:6.2f}  [{min(values) * 1e3:.2f} .. {max(values) * 1e3:.2f}]")
    print(f"  torch / gpulab: {statistics.median(ratios):.3f}x [{min(ratios):.3f} .. {max(ratios):.3f}]; "
          f"weights after 3 steps identical: {identical}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "relu_pool.json").write_text(json.dumps(
            {"git_commit": git_commit(), "device": str(device), "precision": precision, "step_s": rows,
             "torch_over_gpulab": ratios, "identical": identical}, indent=2))


if __name__ == "__main__":
    main()
