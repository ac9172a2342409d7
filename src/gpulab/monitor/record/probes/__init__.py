"""The probes: one module per recorded concern, each installing and removing its own hooks and
patches and writing only through the sink (record/sink.py). recorder.py lists them, in the order
they are installed.

    loaders.py      data loading: DataLoader fetches (data wait), where each loader was built, its
                    batch size, which one fed each step
    transforms.py   per-sample transforms inside a fetch, timed in a window (with the module hooks)
    modules.py      nn.Module calls (global forward hooks): the outermost one is compute
    autograd.py     backward, autograd.grad, the optimizers' step and zero_grad; two step rules
    distributed.py  torch.distributed's collectives and waits, the rank; ddp.py: DDP's wait for its
                    allreduce at the end of backward
    processes.py    forks, multiprocessing children's end, torch's threads under --try threads=N
    trainer.py      gpulab's own trainer's phases (PhaseTimer)
    compiled.py     torch.compile: compiles, recompiles, graph breaks, CUDA graph skips
    cuda.py         CUDA: host syncs and copies (sync_debug.py: torch's sync debug mode; sites.py:
                    the user's lines), the "cuda" record
    kernels.py      the kernel window (CUDA): kernels per step and device busy, torch's profiler
    memory_window.py  the memory window: one step's peak and what it is made of; out of memory
    stacks.py       the stack sampler: the hottest user line of each category
"""
