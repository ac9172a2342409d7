"""A training step compiled with mode="reduce-overhead" (CUDA graphs) whose weight is given new
memory every few steps (`p.data = ...`, as weight-averaging and reloading code does): the recorded
graphs read the old address, so cudagraph trees record them again - each time a recording's
cost, said only in a DEBUG log line nobody reads (pytorch/pytorch#156820).

The script's own truth: how many times it gave the weight new memory after the first step
(planted line). gpulab profile must name the re-recording with what moved and the fix (update
the weight in place). Needs a CUDA GPU.

usage: compile_cudagraph_rerecord.py [STEPS]
"""

import sys

import torch
from torch import nn


def main(steps: int) -> None:
    if not torch.cuda.is_available():
        sys.exit("compile_cudagraph_rerecord.py needs a CUDA GPU")
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = torch.compile(model, mode="reduce-overhead")
    moved = 0
    for step in range(steps):
        x, y = torch.randn(128, 256, device=device), torch.randint(0, 10, (128,), device=device)
        torch.compiler.cudagraph_mark_step_begin()
        loss = nn.functional.cross_entropy(compiled(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 5 == 4 and step < steps - 1:
            with torch.no_grad():
                model[0].weight.data = model[0].weight.data.clone()  # planted: the weight in new memory
            moved += 1
    torch.cuda.synchronize()
    print(f"TRUTH steps {steps} weight_moved {moved}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
