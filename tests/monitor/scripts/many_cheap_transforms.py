"""Planted: many cheap per-sample transforms in __getitem__ - nn.Modules and plain callables, as
torchvision's ToTensor/Normalize are - on 28x28 images, batch 64, num_workers=0, and a small
LSTM, as pytorch/examples' mnist_rnn has them: about a third of each step waits for data.

The script measures its own data wait (time blocked in next() of the training loop) and prints
its share of the step, the median over its steps: "many_cheap_transforms: data share X".
"""

import statistics
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class ToTensor:
    """uint8 HxW -> float 1xHxW in [0, 1] (a plain callable)."""

    def __call__(self, image):
        return image.unsqueeze(0).to(torch.float32).div(255)


class Normalize(nn.Module):
    def __init__(self, mean: float, std: float):
        super().__init__()
        self.mean, self.std = mean, std

    def forward(self, x):
        return (x - self.mean) / self.std


class Clamp(nn.Module):
    def forward(self, x):
        return x.clamp(-3.0, 3.0)


class Squeeze:
    def __call__(self, x):
        return x.squeeze(0)


class Compose:
    """The user's own Compose (no torchvision): calls each transform in turn."""

    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)  # called: the line the report gives for each transform
        return x


class Digits(Dataset):
    def __init__(self, n: int):
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=generator)
        self.labels = torch.randint(0, 10, (n,), generator=generator)
        transforms = [ToTensor(), Normalize(0.1307, 0.3081), Clamp(), Squeeze()]
        self.transform = Compose(transforms)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.transform(self.images[i]), self.labels[i]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(28, 64, batch_first=True)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.fc(out[:, -1])


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(Digits(64 * 120), batch_size=64, shuffle=True)
    shares = []
    it = iter(loader)
    while True:
        t0 = time.perf_counter()
        try:
            X, y = next(it)
        except StopIteration:
            break
        waited = time.perf_counter() - t0
        loss = nn.functional.cross_entropy(model(X), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        shares.append(waited / (time.perf_counter() - t0))
    print(f"many_cheap_transforms: data share {statistics.median(shares):.3f}")


if __name__ == "__main__":
    main()
