"""Lightning with its LightningModule compiled, as Lightning's docs show (`torch.compile(model)`,
then `trainer.fit`): 200 samples in batches of 64, so the epoch ends on a batch of 8 - a shape the
compiled training_step has not seen, one recompile. The user's own line into the compiled code
is `trainer.fit`; the function that recompiles is training_step, called from inside Lightning.

Prints its truth: the batch sizes it trained on (read outside the compiled code, by a callback)
and the line torch names the compiled function by (its code's first line, the `def`). Random
weights, no downloads.

usage: lightning_compiled.py [BACKEND]
  BACKEND  torch.compile's backend (default inductor, what users get); the recompile is dynamo's
           whatever the backend: aot_eager compiles the same graphs in a fraction of the time
"""

import logging
import sys
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning as L


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))

    def training_step(self, batch, i):  # planted: compiled; a last batch of 8 recompiles it
        X, y = batch
        return nn.functional.cross_entropy(self.net(X), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class BatchSizes(L.Callback):
    def __init__(self):
        self.seen: set[int] = set()

    def on_train_batch_start(self, trainer, module, batch, i):
        self.seen.add(len(batch[0]))


if __name__ == "__main__":
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(200, 32), torch.randint(0, 4, (200,)))
    sizes = BatchSizes()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[sizes])
    backend = sys.argv[1] if len(sys.argv) > 1 else "inductor"
    trainer.fit(torch.compile(Classifier(), backend=backend), DataLoader(data, batch_size=64))
    print(f"lightning_compiled: batch_sizes {sorted(sizes.seen)} "
          f"training_step_line {Classifier.training_step.__code__.co_firstlineno}", flush=True)
