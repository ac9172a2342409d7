"""What this machine has: its GPUs as NVML and torch see them, and which ones this process may use.

- `nvml`: starting NVML, and the one funnel every NVML query in gpulab goes through (one error policy).
- `nvml_gpus`: the one reader of NVML's facts about the GPUs (the driver, each GPU's static facts
  and readings), for `gpulab devices` and the profiler's sampler.
- `visible`: CUDA_VISIBLE_DEVICES, read the way CUDA reads it.
- `nvml_facts`: what NVML says, as `gpulab devices` reports it; `torch_facts`: torch's build and GPUs;
  `matching`: NVML's GPUs matched to torch's `cuda:N` by UUID (hidden GPUs, MIG);
  `verdict`: can this torch use these GPUs? One verdict and its fix.
- `describe`: everything `gpulab devices` shows, as plain data; `cli`: the command itself.

`nvml`, `nvml_gpus`, `nvml_facts` and `visible` never import torch (the profiler's parent process
samples GPUs with them), and this file imports nothing, so importing them stays torch-free.
"""
