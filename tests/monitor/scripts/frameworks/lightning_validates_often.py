"""Lightning: validation every 5 training batches (val_check_interval=5) over a validation loader
of 20 batches, each taking ~3 ms more to score (a metric of its own) - validation set too often.

The script prints its truth, by Lightning's own hooks: the seconds inside validation (from
on_validation_start to on_validation_end, the sanity check included) and the seconds of the fit.
Random weights, no downloads, no logger.
"""

import logging
import time
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning as L


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        self.validating_s = 0.0

    def training_step(self, batch, i):
        X, y = batch
        return nn.functional.cross_entropy(self.net(X), y)

    def validation_step(self, batch, i):
        X, y = batch
        time.sleep(0.003)  # a metric of its own, say
        return nn.functional.cross_entropy(self.net(X), y)

    def on_validation_start(self):
        self._validation_t0 = time.perf_counter()

    def on_validation_end(self):
        self.validating_s += time.perf_counter() - self._validation_t0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main():
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    train = DataLoader(TensorDataset(torch.randn(40 * 16, 32), torch.randint(0, 4, (40 * 16,))), batch_size=16)
    val = DataLoader(TensorDataset(torch.randn(20 * 16, 32), torch.randint(0, 4, (20 * 16,))), batch_size=16)  # built: val
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, val_check_interval=5, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    model = Classifier()
    start = time.perf_counter()
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val)
    print(f"lightning_validates_often: validated {model.validating_s:.2f} s of {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
