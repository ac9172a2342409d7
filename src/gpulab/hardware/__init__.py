"""What this machine has: its GPUs as NVML and torch see them, and which ones this process may use.

- `nvml`: starting NVML, and the one funnel every NVML query in gpulab goes through (one error policy).
- `visible`: CUDA_VISIBLE_DEVICES, read the way CUDA reads it.
- `install`: can this torch use these GPUs? The facts, matched by UUID, one verdict and its fix.
- `describe`: everything `gpulab devices` shows, as plain data; `cli`: the command itself.

`nvml` and `visible` never import torch (the profiler's parent process samples GPUs with them), and
this file imports nothing, so importing them stays torch-free.
"""
