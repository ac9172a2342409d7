"""Planted: a DataLoader subclass whose iterator is a plain list iterator - one that takes no weak
reference - so that whatever gpulab keeps of the iterators it sees must do without one.

usage: plain_iterator.py
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class ListLoader(DataLoader):
    def _get_iterator(self):
        return iter([batch for batch in DataLoader(self.dataset, batch_size=self.batch_size)])


def main():
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(16 * 12, 8), torch.randint(0, 2, (16 * 12,)))
    for X, y in ListLoader(data, batch_size=16):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        optimizer.step()
    print("plain_iterator: done")


if __name__ == "__main__":
    main()
