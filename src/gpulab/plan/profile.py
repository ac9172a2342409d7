"""What `gpulab.plan.profile_step` measures of one training step (in a child process), what
`gpulab.plan.step` reads back and `gpulab.plan.predict` reads: `StepProfile` (plain numbers,
written to and read from JSON)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class StepProfile:
    batch: int
    """Samples per device per step."""
    step_s: float
    before_backward_s: float
    """Data and forward."""
    backward_s: float
    after_backward_s: float
    """Optimizer (and the step's bookkeeping)."""
    bucket_bytes: list[int]
    bucket_ready_s: list[float]
    """When each bucket's last gradient landed, seconds after backward began."""
    device: str
    threads: int
    copies: int
    """How many ran at once, in step: each step ended with a 4-byte allreduce between them, so
    step times include waiting for the slowest of them, as ranks do."""
    step_times_s: list[float]
    """Every timed step (of every copy): ranks wait for the slowest each step, so the spread counts."""
    overlap: float = 1.0
    """The share of its idle speed at which an allreduce progresses during backward: 1 when it runs
    as fast as on idle devices. Measured when copies > 1 (on a CPU, gloo and the network stack
    need the cores backward is using); else 1, as for NCCL on a GPU."""
    unit_bytes: list[int] = field(default_factory=list)
    """The parameters of each unit --shard fsdp gathers at once, in forward order, the root's
    own last (parallel/sharded.py: shard_units)."""
    sharded_step_s: float | None = None
    """With --shard fsdp and copies > 1: the copies' step sharded over them (FSDP2), measured."""
    sharded_peak: int | None = None
    """... and that sharded step's peak memory per device (bytes), FSDP's own buffers included."""
    train_samples: int | None = None
    """The training set's size: a batch per device beyond its share is no batch a run can take."""
    memory: dict | None = None
    """One step's memory on the device (gpulab.memory.step, bytes): peak, at_peak (the peak split
    into parameters, gradients, optimizer_state, activations, inputs, other_kept, temporaries),
    sizes, batch, and largest_unit (the parameters sharding gathers at once)."""

    def expected_slowest_s(self, groups: int) -> float:
        """The mean step time when `groups` such groups of copies wait for each other every step,
        each group's step drawn from the measured steps (independently): the expected maximum
        E[max] = sum_i x_(i) * ((i/n)^g - ((i-1)/n)^g) over the sorted times x_(1..n)."""
        xs = sorted(self.step_times_s)
        n = len(xs)
        return sum(x * ((i / n) ** groups - ((i - 1) / n) ** groups) for i, x in enumerate(xs, start=1))

    def to_dict(self) -> dict:
        return asdict(self)
