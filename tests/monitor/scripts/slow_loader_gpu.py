"""An input-bound GPU loop: each sample takes 2 ms to "decode" in the main process (num_workers=0),
the model on the GPU is small, so the GPU waits for every batch. gpulab profile must call this
input_pipeline, pointing into __getitem__.
"""

import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SlowDataset(Dataset):
    def __len__(self):
        return 640

    def __getitem__(self, i):
        time.sleep(0.002)  # planted: a slow decode / disk read per sample
        return torch.randn(1024), i % 10


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("slow_loader_gpu.py needs a CUDA GPU")
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(SlowDataset(), batch_size=16, shuffle=True, pin_memory=True)
    for X, y in loader:
        X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = nn.functional.cross_entropy(model(X), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
