"""A compiled model whose forward reads a tensor's value with `.item()`: torch.compile cannot keep
a Python number in its graph, so it breaks the graph there - every call runs two compiled pieces
with Python between them - and prints nothing about it unless asked.

The script's own truth: it knows the line that breaks the graph (planted) and counts its steps.
gpulab profile must list the graph break with its reason (Tensor.item()) and that line, and say
the fix (keep the value on the device, or capture_scalar_outputs).

usage: compile_graph_break.py [STEPS]
"""

import sys

import torch
from torch import nn


class ScaledMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 128), nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        scale = h.abs().mean().item()  # planted: .item() in forward breaks the compiled graph
        return self.fc2(h / (scale + 1.0))


def main(steps: int) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = ScaledMLP()
    compiled = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    X, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    for _ in range(steps):
        loss = nn.functional.cross_entropy(compiled(X), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    planted = next(i for i, line in enumerate(open(__file__), 1) if "# planted:" in line and "item()" in line)
    counters = torch._dynamo.utils.counters  # torch's own counts
    print(f"TRUTH steps {steps} graph_break_line {__file__.rsplit('/', 1)[-1]}:{planted} "
          f"frames_compiled {counters['frames']['ok']} graph_breaks {sum(counters['graph_break'].values())}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
