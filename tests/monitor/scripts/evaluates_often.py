"""Planted: an evaluation every 10 steps, over a validation DataLoader of 30 batches - as a
Lightning val_check_interval or an HF Trainer eval_steps set too small does.

gpulab profile must name the evaluation with its share of the training time and the fix that
evaluates less often. The script prints the seconds its evaluations took and its loop's seconds,
by its own clock.
"""

import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train = DataLoader(TensorDataset(torch.randn(1280, 64), torch.randint(0, 4, (1280,))), batch_size=32, shuffle=True)
    val = DataLoader(TensorDataset(torch.randn(960, 64), torch.randint(0, 4, (960,))), batch_size=32)
    evaluating_s = 0.0
    start = time.perf_counter()
    step = 0
    for _ in range(2):
        for X, y in train:
            loss = nn.functional.cross_entropy(model(X), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step % 10 == 0:
                t0 = time.perf_counter()
                with torch.no_grad():
                    for Xv, yv in val:  # planted: an evaluation every 10 steps
                        nn.functional.cross_entropy(model(Xv), yv)
                        time.sleep(0.002)  # a metric of its own, say
                evaluating_s += time.perf_counter() - t0
    print(f"evaluates_often: evaluated {evaluating_s:.2f} s of {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
