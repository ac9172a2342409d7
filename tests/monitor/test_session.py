"""The Python API (`gpulab.monitor.profile`) and the recorder behind it, in this process."""

from __future__ import annotations

import json
import time
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.nn.modules import module as module_module
from torch.optim import optimizer as optim_module
from torch.utils.data.dataloader import _BaseDataLoaderIter

import gpulab.monitor
from gpulab.errors import UserError
from gpulab.io import CannotWrite
from gpulab.monitor.record import patches
from gpulab.train import step as phases
from gpulab.train.step import PhaseTimer
from tests.conftest import disk_full_for
from tests.monitor.reports import read_report


def train_steps(model, optimizer, batches, on_step=None):
    for X, y in batches:
        loss = nn.functional.cross_entropy(model(X), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if on_step:
            on_step()


def tiny():
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_steps_come_from_optimizer_steps(tmp_path):
    model, optimizer = tiny()
    batches = [(torch.randn(16, 8), torch.randint(0, 3, (16,)))] * 9
    with gpulab.monitor.profile(out=tmp_path, quiet=True) as p:
        train_steps(model, optimizer, batches)
    assert p.report["steps"] == 9
    assert p.report["phases"]["compute"] > 0
    assert (tmp_path / "report.json").is_file() and (tmp_path / "timeline.png").is_file()


def test_replays_of_a_graph_that_recorded_an_optimizer_step_are_the_steps(tmp_path, monkeypatch):
    # The profiler's bookkeeping around CUDA graphs, on a CPU: torch's capture and replay need
    # CUDA, so they are stood in for by calls that do nothing (the profiler wraps whatever is
    # there). The real thing on a GPU: test_gpu.py::test_replays_of_a_recorded_whole_step_are_the_steps.
    for name in ("capture_begin", "capture_end", "replay"):
        monkeypatch.setattr(torch.cuda.CUDAGraph, name, lambda graph, *args, **kwargs: None)
    model, optimizer = tiny()
    batch = [(torch.randn(16, 8), torch.randint(0, 3, (16,)))]
    whole_step, forward_only = object.__new__(torch.cuda.CUDAGraph), object.__new__(torch.cuda.CUDAGraph)
    with gpulab.monitor.profile(out=tmp_path, quiet=True) as p:
        train_steps(model, optimizer, batch * 3)  # the warm-up: 3 steps
        torch.cuda.CUDAGraph.capture_begin(whole_step)
        train_steps(model, optimizer, batch)  # recorded, not run: no step
        torch.cuda.CUDAGraph.capture_end(whole_step)
        torch.cuda.CUDAGraph.capture_begin(forward_only)  # torch.compile's graph of a forward
        model(batch[0][0])
        torch.cuda.CUDAGraph.capture_end(forward_only)
        for _ in range(20):
            torch.cuda.CUDAGraph.replay(forward_only)  # holds no optimizer step: no step
            torch.cuda.CUDAGraph.replay(whole_step)  # one step each
    assert p.report["steps"] == 23 and p.report["steps_found"] == "found from optimizer.step()"


def test_explicit_step_marks_replace_optimizer_steps(tmp_path):
    model, optimizer = tiny()
    batches = [(torch.randn(16, 8), torch.randint(0, 3, (16,)))] * 2
    with gpulab.monitor.profile(out=tmp_path, quiet=True) as p:
        for _ in range(5):  # one "step" = two optimizer steps (say, gradient accumulation done by hand)
            train_steps(model, optimizer, batches)
            p.step()
    assert p.report["steps"] == 5


def test_everything_is_restored_after_the_session(tmp_path):
    originals = (nn.Module.__call__, DataLoader.__iter__, _BaseDataLoaderIter.__next__, torch.autograd.backward,
                 torch.optim.Optimizer.zero_grad, PhaseTimer.phase, list(phases._listeners))
    hooks = (len(optim_module._global_optimizer_pre_hooks), len(optim_module._global_optimizer_post_hooks),
             len(module_module._global_forward_pre_hooks), len(module_module._global_forward_hooks))
    model, optimizer = tiny()
    with gpulab.monitor.profile(out=tmp_path, quiet=True):
        train_steps(model, optimizer, [(torch.randn(4, 8), torch.randint(0, 3, (4,)))])
    assert (nn.Module.__call__, DataLoader.__iter__, _BaseDataLoaderIter.__next__, torch.autograd.backward,
            torch.optim.Optimizer.zero_grad, PhaseTimer.phase, list(phases._listeners)) == originals
    assert (len(optim_module._global_optimizer_pre_hooks), len(optim_module._global_optimizer_post_hooks),
            len(module_module._global_forward_pre_hooks), len(module_module._global_forward_hooks)) == hooks
    assert not patches.installed()
    assert "item" not in vars(torch.Tensor)  # CUDA wrappers (if any were installed) are gone too


def test_an_exception_still_writes_a_partial_report_and_propagates(tmp_path):
    model, optimizer = tiny()
    batches = [(torch.randn(16, 8), torch.randint(0, 3, (16,)))] * 4
    with pytest.raises(RuntimeError, match="boom"):
        with gpulab.monitor.profile(out=tmp_path, quiet=True):
            train_steps(model, optimizer, batches)
            raise RuntimeError("boom")
    report = read_report(tmp_path)
    assert report["steps"] == 4
    assert report["error"] == "RuntimeError: boom" and report["complete"] is False
    assert nn.Module.__call__.__name__ == "_wrapped_call_impl"  # unpatched despite the exception


def test_a_full_disk_is_one_line_and_the_block_s_own_error_goes_on(tmp_path, monkeypatch, capsys):
    model, optimizer = tiny()
    batches = [(torch.randn(16, 8), torch.randint(0, 3, (16,)))] * 4
    disk_full_for(monkeypatch, "timeline.png")
    with pytest.raises(CannotWrite, match="cannot write .*timeline.png: No space left on device; free space"):
        with gpulab.monitor.profile(out=tmp_path / "a", quiet=True):
            train_steps(model, optimizer, batches)
    with pytest.raises(RuntimeError, match="boom"):
        with gpulab.monitor.profile(out=tmp_path / "b", quiet=True):
            train_steps(model, optimizer, batches)
            raise RuntimeError("boom")
    assert "cannot write" in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.tmp")) and not (tmp_path / "a" / "timeline.png").exists()


def test_one_session_at_a_time(tmp_path):
    with gpulab.monitor.profile(out=tmp_path / "a", quiet=True):
        with pytest.raises(UserError, match="already running"):
            with gpulab.monitor.profile(out=tmp_path / "b", quiet=True):
                pass


def test_bad_settings_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="--interval -1"):
        gpulab.monitor.profile(out=tmp_path, interval_s=-1)


class SleepyDataset(Dataset):
    def __len__(self):
        return 96

    def __getitem__(self, i):
        time.sleep(0.001)
        return torch.randn(8), i % 3


def test_dataloader_wait_with_forked_workers_is_data_wait_and_workers_record_nothing(tmp_path):
    model, optimizer = tiny()
    loader = DataLoader(SleepyDataset(), batch_size=16, num_workers=2, multiprocessing_context="fork")
    with gpulab.monitor.profile(out=tmp_path, quiet=True, warmup_steps=0) as p:
        train_steps(model, optimizer, loader)
    report = p.report
    assert report["steps"] == 6
    assert report["data_loaders"][0]["num_workers"] == 2
    assert report["phases"]["data_wait"] > 0
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert "DataLoader.__iter__" in names and names.count("next(DataLoader)") >= 6


def test_trainer_phases_arrive_as_spans(tmp_path):
    timer = PhaseTimer([torch.device("cpu")])
    model, optimizer = tiny()
    X, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    with gpulab.monitor.profile(out=tmp_path, quiet=True, warmup_steps=0) as p:
        for _ in range(3):
            with timer.phase("data"):
                time.sleep(0.005)
            with timer.phase("forward_backward"):
                nn.functional.cross_entropy(model(X), y).backward()
            with timer.phase("optimizer"):
                optimizer.step()
    assert p.report["phases"]["data_wait"] > 0  # the trainer's "data" phase counts as waiting for data
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"data", "forward_backward", "optimizer", "Linear", "SGD.step"} <= names
    assert set(timer.summary()) == {"data", "forward_backward", "optimizer"}  # PhaseTimer unchanged


def test_in_memory_loader_with_tensor_dataset(tmp_path):
    model, optimizer = tiny()
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    with gpulab.monitor.profile(out=tmp_path, quiet=True) as p:
        train_steps(model, optimizer, DataLoader(data, batch_size=8))
    assert p.report["steps"] == 8
    assert p.report["data_loaders"][0]["where"].endswith("test_session.py:" + str(_line_of("for X, y in batches:")))


def _line_of(text: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


def test_torch_compile_traces_through_the_patched_calls_without_graph_breaks(tmp_path):
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # this test's compiles only
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    compiled = torch.compile(model, backend="aot_eager")  # no C++ toolchain needed
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(8, 16), torch.randint(0, 4, (8,)))] * 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gpulab.monitor.profile(out=tmp_path, quiet=True) as p:
            train_steps(compiled, optimizer, batches)
    assert p.report["steps"] == 4
    assert not torch._dynamo.utils.counters["graph_break"]
    assert not [w for w in caught if "global hooks" in str(w.message)]  # gpulab's hooks warn nobody


@pytest.mark.parametrize("ending, exit_code, error", [
    (SystemExit(0), 0, None), (SystemExit(None), 0, None), (SystemExit(3), 3, "SystemExit: 3"),
    (SystemExit("why"), 1, "SystemExit: why"), (KeyboardInterrupt(), 130, "KeyboardInterrupt"),
])
def test_a_block_left_by_sys_exit_or_ctrl_c_ends_as_python_would_end(tmp_path, ending, exit_code, error):
    model, optimizer = tiny()
    batches = [(torch.randn(16, 8), torch.randint(0, 3, (16,)))] * 4
    with pytest.raises(type(ending)):
        with gpulab.monitor.profile(out=tmp_path, quiet=True):
            train_steps(model, optimizer, batches)
            raise ending
    report = read_report(tmp_path)
    assert (report["exit_code"], report["error"]) == (exit_code, error)
    assert "failure" not in [f["cause"] for f in report["findings"]]


def test_an_empty_out_and_a_step_outside_the_block_are_user_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="out ''"):
        gpulab.monitor.profile(out="")
    with pytest.raises(UserError, match="inside the block"):
        gpulab.monitor.profile(out="p").step()
    assert not list(tmp_path.iterdir())
