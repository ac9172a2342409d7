"""Where a training step's memory goes, measured with public torch APIs; shared by the profiler
(monitor/record/), the planner (plan/) and the trainer (train/).

    tensors.py   what tensors hold: unique storages, by category (parameters, gradients,
                 optimizer state, inputs), everything reachable (the CPU has no allocator counter)
    records.py   what a measurement says: StepMemory, OutOfMemory (typed dicts, torch-free)
    step.py      StepMemoryProbe: one step measured - live bytes over time, the peak, and the split at
                 the peak into parameters, gradients, optimizer state, activations saved for
                 backward (per module), inputs and other memory
    oom.py       an out-of-memory error read: how much was asked for, on which device, and what
                 was in use by category at that moment
    peak.py      the peak of a whole epoch per device, cheaply (CUDA's allocator; the process's
                 peak resident memory on a CPU)
"""
