"""The whole training step - forward, loss, backward, optimizer - recorded once as a CUDA graph
and replayed for every batch, as torch's CUDA graph notes show whole-network capture (and as
`gpulab train --compile graphs` trains). No optimizer.step() or backward() is called per step:
each replay is one.

The script's own truth: how many replays (training steps) it ran, and the GPU time of a replay
(CUDA events around the replays). gpulab profile must count the replays as the steps. Needs a
CUDA GPU.

usage: whole_step_graph.py [STEPS]
"""

import sys

import torch
from torch import nn


def main(steps: int) -> None:
    if not torch.cuda.is_available():
        sys.exit("whole_step_graph.py needs a CUDA GPU")
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)
    x, y = torch.randn(256, 512, device=device), torch.randint(0, 10, (256,), device=device)

    def step() -> torch.Tensor:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: autograd's and the optimizer's buffers, cuBLAS's workspace
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream().wait_stream(side)
    optimizer.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step()

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        x.copy_(torch.randn_like(x))
        graph.replay()  # planted: the whole step, with no Python call into the model or the optimizer
    end.record()
    end.synchronize()
    print(f"TRUTH steps {steps} gpu_ms_per_step {start.elapsed_time(end) / steps:.3f} loss {loss.item():.4f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
