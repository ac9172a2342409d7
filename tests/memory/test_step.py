"""One step's memory measured by StepMemoryProbe, held against plain PyTorch's own counts, and
what the probe leaves on the script's tensors: nothing (issue 33)."""

import os
import subprocess
import sys
import weakref

import pytest
import torch
from torch import nn

from gpulab.memory.step import StepMemoryProbe
from gpulab.memory.tensors import reachable_from

CPU = torch.device("cpu")


def training(set_to_none: bool = True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    optimizer = torch.optim.Adam(model.parameters())
    X, y = torch.randn(128, 256), torch.randint(0, 10, (128,))

    def step(note_batch=None, during=None):
        if note_batch:
            note_batch((X, y))
        optimizer.zero_grad(set_to_none=set_to_none)
        loss = nn.functional.cross_entropy(model(X), y)
        if during:
            during()
        loss.backward()
        optimizer.step()

    step.batch = (X, y)
    return model, optimizer, step


def saved_by_autograd(model, X, y) -> int:
    """Bytes autograd saves for backward in one forward, counted by the test's own hooks."""
    excluded = {p.data_ptr() for p in model.parameters()} | {X.data_ptr(), y.data_ptr()}  # and the batch
    saved = {}

    def pack(t):
        if t.data_ptr() not in excluded:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        nn.functional.cross_entropy(model(X), y)
    return sum(saved.values())


def held_on_tensors(tensors) -> tuple[int, int]:
    finalizers = sum(isinstance(info.weakref(), torch.Tensor) for info in list(weakref.finalize._registry.values()))
    return sum(weakref.getweakrefcount(t) for t in tensors), finalizers


def test_the_split_matches_plain_pytorch_and_nothing_is_left_on_the_tensors():
    model, optimizer, step = training()
    step(), step()  # Adam's state and the gradients exist
    probe = StepMemoryProbe(CPU)
    probe.prepare()
    step()
    probe.begin([model], [optimizer])
    seen = {}

    def look(when: str) -> None:
        tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None),
                   *(v for s in optimizer.state.values() for v in s.values())]
        seen[when] = held_on_tensors(tensors)

    look("at the start")
    step(note_batch=probe.note_inputs, during=lambda: look("in the step"))
    memory = probe.end()
    n = sum(p.numel() * 4 for p in model.parameters())
    assert memory["sizes"]["parameters"] == n
    assert memory["sizes"]["optimizer_state"] == 2 * n + 4 * len(list(model.parameters()))  # two moments + step
    assert memory["sizes"]["gradients"] == n
    assert memory["sizes"]["activations"] == saved_by_autograd(model, *step.batch)
    assert memory["batch"] == 128
    # the peak is in Adam's step: backward has freed every saved tensor by then (the allocator's records)
    assert memory["peak_t"] > 0 and memory["at_peak"]["activations"] == 0 and memory["at_peak"]["gradients"] == n
    # no weak reference, no finalizer on any of the script's tensors
    assert seen == {"at the start": (0, 0), "in the step": (0, 0)}
    assert reachable_from([vars(probe)], CPU).nbytes == 0  # and the probe keeps none of them


def measured(model: nn.Module, optimizer, step) -> dict:
    """One step measured as the profiler measures it (the step before it seen by the profiler)."""
    step(), step()
    probe = StepMemoryProbe(CPU)
    probe.prepare()
    step()
    probe.begin([model], [optimizer])
    step(note_batch=probe.note_inputs)
    return probe.end()


def test_gradients_added_to_in_place_are_counted_once():
    model, optimizer, step = training(set_to_none=False)  # zero_grad() zeroes, backward adds in place
    memory = measured(model, optimizer, step)
    n = sum(p.numel() * 4 for p in model.parameters())
    assert memory["sizes"]["gradients"] == n
    assert memory["at_peak"]["gradients"] == n


MIB = 2**20


def test_a_gradient_made_at_the_peak_is_a_gradient_not_a_temporary():
    """Two Linear(1024, 1024), plain SGD, zero_grad(set_to_none) after the step: backward's peak is
    the allocation of the first layer's weight gradient (4 MiB, the second's already there), which
    backward hands over only afterwards - it was counted as a temporary (a helper's finding: 64 MiB
    of a 4096-wide layer's gradient called temporaries)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.Linear(1024, 1024, bias=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    X = torch.randn(256, 1024)

    def step(note_batch=None):
        if note_batch:
            note_batch((X,))
        model(X).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    at_peak = measured(model, optimizer, step)["at_peak"]
    assert at_peak["gradients"] == 8 * MIB and at_peak["parameters"] == 8 * MIB and at_peak["inputs"] == 1 * MIB
    assert at_peak["temporaries"] < 1.1 * MIB  # an activation's gradient (1 MiB), none of the weights'


def test_inputs_are_the_batch_while_it_lives_never_a_model_s_output_handed_on():
    """Two micro-batches, each a fresh batch (the first freed before the second's backward), and a
    model made of two modules called in turn (the first one's output is no batch): at the peak the
    inputs are one batch, 1 MiB of X and 1 MiB of y."""
    torch.manual_seed(0)
    enc, head = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()), nn.Linear(1024, 1024)
    optimizer = torch.optim.SGD([*enc.parameters(), *head.parameters()], lr=1e-3)

    def step(note_batch=None):
        for _ in range(2):
            X, y = torch.randn(256, 1024), torch.randn(256, 1024)
            if note_batch:
                note_batch((X, y))
                note_batch((X,))  # as the profiler notes each outermost module call's arguments
            h = enc(X)
            if note_batch:
                note_batch((h,))
            (nn.functional.mse_loss(head(h), y) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()

    memory = measured(enc, optimizer, step)
    assert memory["at_peak"]["inputs"] == 2 * MIB
    assert memory["sizes"]["inputs"] == 4 * MIB  # both micro-batches, over the step


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc/self/task")
def test_the_profiler_s_own_threads_leave_the_script_s_signals_to_its_main_thread(tmp_path):
    """torch's profiler starts a thread of its own (kineto's) when the probe starts it: a SIGTERM the
    kernel hands to that thread never wakes a main thread blocked in a lock (a Pool worker waiting
    for its next task), and the script's handler would never run. Checked in a fresh process, where
    the profiler starts its thread."""
    script = tmp_path / "threads.py"
    script.write_text(
        "import os, signal, torch\n"
        "from gpulab.memory.step import StepMemoryProbe\n"
        "before = set(os.listdir('/proc/self/task'))\n"
        "probe = StepMemoryProbe(torch.device('cpu'))\n"
        "probe.prepare()\n"
        "for tid in sorted(set(os.listdir('/proc/self/task')) - before) + [str(os.getpid())]:\n"
        "    status = open(f'/proc/self/task/{tid}/status').read()\n"
        "    blocked = int(status.split('SigBlk:')[1].split()[0], 16)\n"
        "    print(bool(blocked >> (signal.SIGTERM - 1) & 1))\n"
        "probe.close()\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    *started, main = out.stdout.split()
    assert started, "the profiler started no thread: the case proves nothing"
    assert started == ["True"] * len(started) and main == "False"  # the main thread still takes them
