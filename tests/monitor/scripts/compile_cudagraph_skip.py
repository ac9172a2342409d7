"""A step compiled with mode="reduce-overhead" (CUDA graphs) that writes into its input in place:
inductor cannot replay a graph whose input it mutates, skips CUDA graphs for it and says so only
in a log nobody reads, so the step runs kernel by kernel.

The script's own truth: the compiled function mutates its input (planted line). gpulab profile
must name the CUDA graph skip with its reason (mutated inputs) and the fix. Needs a CUDA GPU.

usage: compile_cudagraph_skip.py [STEPS]
"""

import sys

import torch
from torch import nn


def main(steps: int) -> None:
    if not torch.cuda.is_available():
        sys.exit("compile_cudagraph_skip.py needs a CUDA GPU")
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    @torch.compile(mode="reduce-overhead")
    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5)  # planted: the compiled step writes into its input: no CUDA graph for it
        return nn.functional.cross_entropy(model(x), y)

    for _ in range(steps):
        x, y = torch.randn(128, 256, device=device), torch.randint(0, 10, (128,), device=device)
        loss = loss_of(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    torch.cuda.synchronize()
    print(f"TRUTH steps {steps} mutates_input True")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
