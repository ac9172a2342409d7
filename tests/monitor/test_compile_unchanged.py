"""gpulab's recorder is invisible to torch.compile: a function that calls what the probes patch or
hook (a module, Tensor methods, backward, the optimizer, a DataLoader, torch.set_num_threads),
compiled with the recorder in place, traces, breaks and recompiles as it does without it - by
torch's own counters (torch._dynamo.utils.counters: frames compiled, graph breaks and their
reasons, recompiles, graphs). dynamo alone (backend="eager"): what it traces is the question,
not inductor's code."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

from gpulab.monitor.config import ProfileConfig
from gpulab.monitor.record.patches import Patches
from gpulab.monitor.record.probes.cuda import CudaSyncProbe
from gpulab.monitor.record.recorder import Recorder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

COUNTED = ("frames", "graph_break", "recompiles", "stats")


def torchs_counters(fn, args: tuple, recording: bool, calls: int = 3, cuda_wrappers: bool = False) -> dict:
    """torch's counters after `calls` calls of torch.compile(fn), the recorder in place or not.
    `cuda_wrappers`: also the CUDA probe's Tensor-method wrappers (installed with a CUDA device
    only: on a CPU put in as that probe puts them, through its wrap_sync_points)."""
    torch._dynamo.reset()
    counters.clear()
    recorder = Recorder(ProfileConfig(stack_interval_s=0)).start(command=["test"]) if recording else None
    extra = Patches()
    try:
        if recording and cuda_wrappers:
            probe = CudaSyncProbe(warmup_steps=1)
            probe.sink = recorder.sink
            probe.wrap_sync_points(extra.patch)
        compiled = torch.compile(fn, backend="eager")
        for _ in range(calls):
            compiled(*args)
    finally:
        extra.undo()
        if recorder is not None:
            recorder.stop(exit_code=0)
    seen = {name: dict(counters[name]) for name in COUNTED}
    torch._dynamo.reset()
    counters.clear()  # the process as it was found: other tests read these counters
    return seen


class Breaks(nn.Module):
    """A module whose forward reads a value to the host: one graph break, inside a module call."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        scale = h.abs().mean().item()
        return self.fc2(h / (scale + 1.0))


def a_model_call(model, x):
    return model(x).sum()


def a_training_step(model, optimizer, x):
    optimizer.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    return loss


def host_reads(x):
    y = x * 2
    return y.sum().item() + sum(y[0].tolist()) + float(y.cpu()[0, 0])


def a_batch_of(loader):
    total = 0.0
    for X, in loader:
        total = total + X.sum()
    return total


def threads_set(x):
    torch.set_num_threads(1)
    return x + 1


def cases():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    breaks = Breaks()
    x = torch.randn(4, 8)
    loader = DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=4)
    return {
        "module call": (a_model_call, (mlp, x), False),
        "graph break in a module": (a_model_call, (breaks, x), False),
        "training step": (a_training_step, (mlp, torch.optim.SGD(mlp.parameters(), lr=0.1), x), False),
        "training step with a break": (a_training_step, (breaks, torch.optim.SGD(breaks.parameters(), lr=0.1), x),
                                       False),
        "host reads (Tensor methods)": (host_reads, (x,), True),
        "DataLoader": (a_batch_of, (loader,), False),
        "set_num_threads": (threads_set, (x,), False),
    }


# Where a compiled optimizer step runs torch's step wrapper, dynamo traces the global optimizer
# step hooks into it (torch's public hooks, which the autograd probe uses): they fold away there,
# but their presence lets dynamo inline torch's empty `_optimizer_step_code` where, without them,
# it compiles it as a frame of its own (with no graph). One frame fewer, nothing else different.
OPTIMIZER_HOOKS_INLINE_ONE_FRAME = {"training step", "training step with a break"}


@pytest.mark.parametrize("case", list(cases()))
def test_torch_compile_counts_the_same_with_the_recorder_in_place(case):
    fn, args, cuda_wrappers = cases()[case]
    # The first compile of a case in a process traces more than later ones (a DataLoader's
    # iterator: dozens of frames, then 3): counted once, untouched by the recorder, then compared.
    torchs_counters(fn, args, recording=False)
    plain = torchs_counters(fn, args, recording=False)
    recorded = torchs_counters(fn, args, recording=True, cuda_wrappers=cuda_wrappers)
    assert plain["frames"], "compiled nothing: the case proves nothing"
    if case in OPTIMIZER_HOOKS_INLINE_ONE_FRAME:
        assert recorded.pop("frames") == {key: n - 1 for key, n in plain.pop("frames").items()}
    assert recorded == plain
