"""Run under torchrun by test_distributed.py: train small models with gpulab's `Distributed`
(or, for cases with "shard": "fsdp", `Sharded`) strategy on fixed global batches (each rank takes its part) and save every rank's parameters.

The models, batches and optimizers are defined here, in plain PyTorch, so that the test builds
exactly the same ones for its reference: one model, `loss.backward(); opt.step()` per batch.

    python -m torch.distributed.run --nproc-per-node K dist_worker.py CASES_JSON OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=1e-2),
}


class Branchy(nn.Module):
    """`unused` never gets a gradient; `rare` only from samples whose first feature is > 1, so
    in some steps only some ranks use it, and in some steps no rank does."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 10)
        self.rare = nn.Linear(8, 10)
        self.unused = nn.Linear(8, 10)

    def forward(self, x):
        out = self.body(x)
        idx = (x[:, 0] > 1.0).nonzero().squeeze(1)
        if len(idx):
            out = out.index_add(0, idx, self.rare(x[idx]))
        return out


def make_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "frozen":  # fine-tuning: the first convolution does not train
        model = make_model("convnet")
        for p in model[0].parameters():
            p.requires_grad_(False)
        return model
    if name == "bnnet":
        return nn.Sequential(
            nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
            nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, 10),
        ).double()
    if name == "convnet":
        return nn.Sequential(
            nn.Conv2d(1, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
            nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10),
        ).double()
    return Branchy().double()


def make_batches(model: str, batch_size: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(batch_size * 100 + steps)
    shape = (8,) if model == "branchy" else (1, 8, 8)
    return [
        (torch.randn(batch_size, *shape, generator=g, dtype=torch.float64), torch.randint(0, 10, (batch_size,), generator=g))
        for _ in range(steps)
    ]


def main(cases: list[dict], out: Path) -> None:
    from gpulab.parallel.distributed import DDPSync, Distributed
    from gpulab.parallel.sharded import Sharded
    from gpulab.parallel.world import from_environment
    from gpulab.train.step import Trainer

    world = from_environment()
    world.connect(torch.device("cpu"), "gloo", timeout_s=60)
    for case in cases:
        model, device, optimizer = make_model(case["model"]), torch.device("cpu"), OPTIMIZERS[case["optimizer"]]
        if case.get("shard") == "fsdp":
            strategy = Sharded(model, world, device, case["batch_size"], optimizer)
        elif case["sync"] == "ddp":
            strategy = DDPSync(model, world, device, case["batch_size"], optimizer)
        else:
            strategy = Distributed(
                model, world, device, case["batch_size"], optimizer, sync_bn=case.get("sync_bn", False),
                bucket_bytes=case.get("bucket_bytes", 25 * 2**20), first_bucket_bytes=case.get("first_bucket_bytes", 2**20),
            )
        trainer = Trainer(strategy, nn.functional.cross_entropy, accumulate=case.get("accumulate", 1))
        for X, y in make_batches(case["model"], case["batch_size"], case["steps"]):
            part = torch.tensor_split(torch.arange(len(y)), world.world_size)[world.rank]  # GlobalBatches' rule
            trainer.train_step(X[part], y[part])
        torch.save(strategy.state_dict()["model"], out / f"{case['name']}-rank{world.rank}.pt")
    world.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), Path(sys.argv[2]))
