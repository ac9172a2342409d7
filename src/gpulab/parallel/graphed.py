"""The whole training step of one GPU - forward, loss, backward, the optimizer's update - recorded
once as a CUDA graph and replayed for every batch (`gpulab train` on one GPU: --compile record, the
eager step, is its default; --compile graphs records the compiled step).

Why: a small model's step is little GPU work behind much Python and many kernel launches, so the
card idles between kernels. A replay is one launch for all of it: the host's part of a step
becomes two copies into the graph's input buffers, the learning rate written to the device, and
the replay (measured: docs/benchmarks.md).

How, as torch's CUDA graph notes describe whole-network capture:
- the step runs a few times on a side stream first (torch.compile compiles, cuDNN picks its
  kernels, autograd and the optimizer create their buffers, cuBLAS its workspace), then the
  model's parameters and buffers and the optimizer's state are put back as they were (state the
  warm-up created - momentum - to zero, which is what the optimizer's first step starts from), so
  the recorded run trains exactly the model that eager training would;
- the graph reads its batch from two buffers of its own, and the learning rate from a
  one-element tensor on the device that `set_lr` writes before each replay: the optimizer must
  take a tensor learning rate inside a graph (fused=True or capturable=True);
- what the step returns (the loss, the top-1 hits) are the graph's own tensors, rewritten by the
  next replay: read them (or add them to the meter) before that.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpulab.errors import UserError

WARMUP_STEPS = 3  # torch's notes: a few eager runs on a side stream before capture


class StepGraph:
    """`step(X, y, *args)` -> tensors, recorded on the first call and replayed on every later one
    (`args`, say the loss function, are the first call's: a replay runs what was recorded).
    `modules` and `optimizers`: what the step changes (their state is put back after warm-up)."""

    def __init__(self, step: Callable[..., tuple[torch.Tensor, ...]],
                 modules: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer], device: torch.device):
        check_capturable(optimizers)
        self.step, self.modules, self.optimizers, self.device = step, modules, optimizers, device
        self.graph: torch.cuda.CUDAGraph | None = None
        self.lr: list[torch.Tensor] = []  # one float32 tensor per parameter group, read by the graph
        self.X = self.y = None
        self.outputs: tuple[torch.Tensor, ...] = ()

    def set_lr(self, lr: float) -> None:
        """The next replay's learning rate (a fill on the device: no copy, no sync)."""
        for t in self.lr:
            t.fill_(lr)

    def __call__(self, X: torch.Tensor, y: torch.Tensor, *args) -> tuple[torch.Tensor, ...]:
        if self.graph is None:
            self._record(X, y, args)
        elif X.shape != self.X.shape or y.shape != self.y.shape:
            raise UserError(f"the step is replayed as a CUDA graph recorded for a batch of {tuple(self.X.shape)}; this "
                            f"batch is {tuple(X.shape)}: every training batch must have the same size "
                            "(or use --compile off)")
        self.X.copy_(X)
        self.y.copy_(y)
        self.graph.replay()
        return self.outputs

    def _record(self, X: torch.Tensor, y: torch.Tensor, args: tuple) -> None:
        self.X, self.y = X.clone(), y.clone()
        groups = [g for opt in self.optimizers for g in opt.param_groups]
        lrs = [float(g["lr"]) for g in groups]
        self.lr = [torch.tensor(lr, dtype=torch.float32, device=self.device) for lr in lrs]
        for group, lr in zip(groups, self.lr):  # what the recorded optimizer step reads
            group["lr"] = lr
        saved = snapshot(self.modules, self.optimizers)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self.step(self.X, self.y, *args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        restore(saved, self.optimizers)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = self.step(self.X, self.y, *args)
        for group, lr in zip(groups, lrs):  # the graph holds the tensors; state_dict() sees numbers
            group["lr"] = lr


def graph_lr(lr: float) -> float:
    """The learning rate a recorded step applies: `lr` as float32 (the same number for float32
    parameters; for float64 ones, rounded)."""
    return torch.tensor(lr, dtype=torch.float32).item()


def check_capturable(optimizers: list[torch.optim.Optimizer]) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            if not (group.get("fused") or group.get("capturable")):
                raise UserError(f"a step recorded as a CUDA graph (--compile record, graphs) records the optimizer's "
                                f"step too: {type(opt).__name__} must be built with fused=True (or capturable=True); "
                                "or use --compile off")
            if group.get("momentum") and group.get("dampening"):  # its first step is not one from zero state
                raise UserError("a step recorded as a CUDA graph (--compile record, graphs): SGD with dampening starts "
                                "from its first gradient, not from zero momentum, which a recording cannot do; use "
                                "dampening=0 or --compile off")


def snapshot(modules: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict[int, tuple]:
    """A copy of every tensor a training step changes - parameters, buffers, optimizer state -
    by id: {id: (tensor, copy)}."""
    tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    tensors += [v for opt in optimizers for state in opt.state.values() for v in state.values()
                if isinstance(v, torch.Tensor)]
    return {id(t): (t, t.detach().clone()) for t in tensors}


@torch.no_grad()
def restore(saved: dict[int, tuple], optimizers: list[torch.optim.Optimizer]) -> None:
    """Every tensor of `saved` back to its copy, in place (the graph records their addresses);
    optimizer state created since (a momentum buffer) to zero: an optimizer's first step starts
    from zero state (SGD's momentum, Adam's moments and step count)."""
    for t, copy in saved.values():
        t.copy_(copy)
    for opt in optimizers:
        for state in opt.state.values():
            for key, v in state.items():
                if not isinstance(v, torch.Tensor):
                    raise UserError(f"a step recorded as a CUDA graph (--compile record, graphs): {type(opt).__name__} "
                                    f"keeps {key!r} as a Python number, which a CUDA graph cannot update; build it "
                                    "with capturable=True (or use --compile off)")
                if id(v) not in saved:
                    v.zero_()
