"""Sets OMP_NUM_THREADS before its own `import torch`, as many scripts do; the profiler must not
have imported torch first (the setting would be ignored)."""

import os

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

print(f"torch threads: {torch.get_num_threads()}")
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(4):
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
