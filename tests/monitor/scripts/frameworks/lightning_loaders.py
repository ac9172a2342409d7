"""Lightning: a training loader (batch 64, a slow __getitem__: the steps wait on it) and a
validation loader (batch 256, fast), each built at its marked line. Lightning iterates the
validation loader first (its sanity check), and both are iterated from inside `trainer.fit(...)`.

usage: lightning_loaders.py single|ddp [EPOCHS]
  single  one process: Trainer(accelerator="cpu", devices=1)
  ddp     Trainer(strategy="ddp", devices=2, accelerator="cpu"): Lightning starts the second
          process itself (no RANK in either one's environment at start) and re-creates the
          loaders with a DistributedSampler from their __init__ signature

Each process prints its truth: its rank from torch.distributed, the training steps it ran and
the batch size of the batches they trained on. Random weights, no downloads, no logger.
"""

import logging
import os
import sys
import time
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning as L

MODE = sys.argv[1]
EPOCHS = int(sys.argv[2]) if len(sys.argv) > 2 else 2
TRAIN_BATCH, VAL_BATCH = 64, 256


class Samples(Dataset):
    def __init__(self, n: int, seconds_per_sample: float):
        self.x = torch.randn(n, 32)
        self.y = torch.randint(0, 4, (n,))
        self.seconds_per_sample = seconds_per_sample

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.seconds_per_sample:
            time.sleep(self.seconds_per_sample)  # a slow read
        return self.x[i], self.y[i]


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        self.trained_batch_sizes: set[int] = set()

    def training_step(self, batch, i):
        X, y = batch
        self.trained_batch_sizes.add(len(X))
        self.dist_rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else None
        return nn.functional.cross_entropy(self.net(X), y)

    def validation_step(self, batch, i):
        X, y = batch
        return nn.functional.cross_entropy(self.net(X), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main():
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    train = DataLoader(Samples(12 * TRAIN_BATCH * (2 if MODE == "ddp" else 1), 0.0002), batch_size=TRAIN_BATCH)  # built: train
    val = DataLoader(Samples(2 * VAL_BATCH, 0.0), batch_size=VAL_BATCH)  # built: val
    devices = {"devices": 2, "strategy": "ddp"} if MODE == "ddp" else {"devices": 1}
    trainer = L.Trainer(accelerator="cpu", max_epochs=EPOCHS, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, **devices)
    model = Classifier()
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val)
    # one write per line: both ranks print at once
    print(f"lightning_loaders: rank {model.dist_rank} steps {trainer.global_step} batch {sorted(model.trained_batch_sizes)} "
          f"pid {os.getpid()}\n", end="", flush=True)


if __name__ == "__main__":
    main()
