"""What a memory measurement says, as plain typed dicts (they go into the profiler's events file
as they are, and the analysis reads them without torch): one measured step, and an
out-of-memory error. Torch-free."""

from __future__ import annotations

from typing import TypedDict


class StepMemory(TypedDict):
    """What one step held on one device (bytes; times are perf_counter seconds)."""
    device: str
    how: str  # how the live bytes were read, in words
    live_start: int
    peak: int
    peak_t: float | None
    live_end: int
    at_peak: dict[str, int]  # the peak split into categories.CATEGORIES; the parts sum to `peak`
    sizes: dict[str, int]  # each category at its largest (activations: all forward saved)
    activations_by_module: list[list]  # [qualified name, class name, bytes], largest first
    batch: int | None  # samples in the batch (its first input's first dimension)
    reserved: int | None  # CUDA: what the caching allocator holds at the step's end
    curve: list[list[float]]  # [time, live bytes] through the step, each point the largest of its span


class OutOfMemory(TypedDict):
    device: str
    requested: int | None  # bytes the failing allocation asked for, from the error's text
    message: str
    where: str | None  # the user's file:line that was running
    module: str | None  # 'layer3.1.conv2 (Conv2d)': the innermost module whose forward was running
    phase: str  # 'forward of layer3.1.conv2 (Conv2d)', 'backward', 'optimizer step (Adam)', ...
    in_use: dict[str, int]  # parameters, gradients, optimizer_state, activations, inputs, other
    total_in_use: int
    device_total: int | None
    limit: int | None  # CUDA: what the allocator may use, when less than the device (set_per_process_memory_fraction)
    process_total: int | None  # CUDA: all this process holds on the device (the error's count), context included
    reserved: int | None
    batch: int | None
    dtype: str | None  # the activations' dtype, for the mixed-precision fix
