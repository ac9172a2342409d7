"""Memory in `gpulab profile` (issue 25): the measured step's split held against the truth of
scripts whose memory is known by hand and by their own saved_tensors_hooks; running out of
memory as a finding that names the line, the phase and the largest category, in whichever
process it happened."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gpulab.cli import main
from gpulab.memory.oom import requested_bytes
from gpulab.memory.categories import CATEGORIES, size
from gpulab.monitor.analyze.memory_findings import oom_fixes
from tests.monitor.reports import read_report

SCRIPTS = Path(__file__).parent / "scripts"


def profile(tmp_path: Path, script: str, *args: str) -> tuple[int, dict]:
    out = tmp_path / "prof"
    code = main(["profile", "--out", str(out), "--", sys.executable, str(SCRIPTS / script), *args])
    return code, read_report(out)


def planted_line(script: str) -> int:
    lines = (SCRIPTS / script).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if "# planted:" in line)


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_the_memory_split_matches_what_the_script_counts_itself(tmp_path, model):
    code, report = profile(tmp_path, "memory_known.py", model, str(tmp_path / "truth.json"))
    assert code == 0
    truth = json.loads((tmp_path / "truth.json").read_text())
    memory = report["memory"]
    dataset = truth.pop("dataset")
    for category, expected in truth.items():  # parameters, gradients, optimizer state, activations, inputs
        assert memory["sizes"][category] == pytest.approx(expected, rel=0.10), category
    # What the step keeps beyond those is the dataset in memory, not one batch more.
    assert memory["at_peak"]["other_kept"] == pytest.approx(dataset, rel=0.03)
    assert set(memory["at_peak"]) == set(CATEGORIES)
    assert sum(memory["at_peak"].values()) == pytest.approx(memory["peak"], rel=0.01)
    # Each case has its own peak: Adam's step over 6 MiB of parameters; the CNN's backward, its
    # 36 MiB of activations partly freed and the convolutions' gradients being made.
    assert memory["peak_phase"] == {"mlp": "optimizer step (Adam)", "cnn": "backward"}[model]
    assert memory["peak"] > memory["live_start"]
    assert memory["batch"] == {"mlp": 256, "cnn": 64}[model]
    top_name, top_class, top_bytes = memory["activations_by_module"][0]
    assert top_class == "ReLU" and top_bytes > 0  # ReLU saves its output: the largest saver in both
    assert report["excluded_steps"]["profiler_window"] == 2  # the window's two steps are not statistics
    assert report["steps"] == 8


def test_profiling_keeps_alive_nothing_the_script_lets_go_of(tmp_path):
    """The DataLoader probe reads the frame that built the loader, the CPU memory window every
    frame's locals: neither may hold what the script drops afterwards."""
    code, report = profile(tmp_path, "lets_go.py", str(tmp_path / "found.json"))
    assert code == 0 and report["memory"]["batch"] == 32  # the memory window measured a step
    assert json.loads((tmp_path / "found.json").read_text()) == {
        "raw_data_freed": True, "steps_whose_previous_batch_lived_on": []}


def test_batches_waiting_in_a_loader_s_iterator_are_kept_memory(tmp_path):
    """With workers, batches that arrive ahead wait in the iterator a `for` loop holds - no local
    of the script's - and the next batch is no allocation of this process's: counted from the
    frames alone, the step began without them and 'other kept' came out a batch below the
    dataset it holds."""
    code, report = profile(tmp_path, "batches_ahead.py", str(tmp_path / "sizes.json"))
    sizes = json.loads((tmp_path / "sizes.json").read_text())
    assert code == 0
    kept = report["memory"]["at_peak"]["other_kept"]
    # the dataset, and no more batches than 2 workers x prefetch_factor 2 send ahead
    assert sizes["dataset"] <= kept <= sizes["dataset"] + 4 * sizes["batch"]


def test_a_loader_whose_iterator_takes_no_weak_reference_trains_as_without_gpulab(tmp_path, capfd):
    code, report = profile(tmp_path, "plain_iterator.py")
    assert code == 0 and "plain_iterator: done" in capfd.readouterr().out
    assert report["steps"] == 12 and "error" not in report["memory"]


def test_running_out_of_memory_is_the_first_finding(tmp_path):
    code, report = profile(tmp_path, "out_of_memory.py")
    assert code == 1  # the script's own exit code
    first = report["findings"][0]
    assert first["cause"] == "out_of_memory"
    assert first["where"].endswith(f"out_of_memory.py:{planted_line('out_of_memory.py')}")
    assert "in forward of" in first["evidence"] and "the largest is activations" in first["evidence"]
    assert "asked for 128.0 MiB" in first["evidence"]
    frees = [f["frees"] for f in first["fixes"]]
    assert frees == sorted(frees, reverse=True) and len(frees) >= 3  # ranked by what each frees
    assert first["fixes"][0]["fix"].startswith("halve the batch")


def test_running_out_of_memory_in_a_child_process_names_it(tmp_path):
    code, report = profile(tmp_path, "out_of_memory.py", "--in-child")
    assert code == 1
    oom = next(f for f in report["findings"] if f["cause"] == "out_of_memory")
    child = next(p for p in report["processes"] if p["role"].startswith("child"))
    assert f"pid {child['pid']}" in oom["evidence"]
    assert oom["where"].endswith(f"out_of_memory.py:{planted_line('out_of_memory.py')}")


def test_a_launcher_s_child_that_runs_out_before_its_first_step_is_named_as_running_out(tmp_path):
    """The job's main process never imports torch (it starts the trainer and waits), its child runs
    out of memory in its first step: the out-of-memory finding keeps its own evidence and fix."""
    out = tmp_path / "prof"
    launcher = ("import subprocess, sys; "
                f"sys.exit(subprocess.call([sys.executable, {str(SCRIPTS / 'out_of_memory.py')!r}, '--first-step']))")
    code = main(["profile", "--out", str(out), "--", sys.executable, "-c", launcher])
    first = read_report(out)["findings"][0]
    assert code == 1 and first["cause"] == "out_of_memory", first
    assert "asked for 128.0 MiB" in first["evidence"] and "never imported torch" not in first["evidence"]


def test_the_size_of_an_allocation_is_read_from_either_allocator():
    cpu = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
           "allocate 134217728 bytes. Error code 12 (Cannot allocate memory)")
    cuda = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
            "1.21 GiB is free. Of the allocated memory 75.03 GiB is allocated by PyTorch")
    assert requested_bytes(cpu) == 134217728
    assert requested_bytes(cuda) == 2 * 2**30
    assert requested_bytes("some other error") is None
    assert size(1536) == "1.5 KiB" and size(3 * 2**30) == "3.0 GiB" and size(12) == "12 B"


def test_the_fixes_are_priced_from_what_was_in_use():
    oom = {"in_use": {"parameters": 100, "gradients": 100, "optimizer_state": 200, "activations": 1000, "inputs": 40},
           "dtype": "float32", "reserved": 3000, "total_in_use": 1500}
    fixes = {f["fix"].split(" ")[0]: f["frees"] for f in oom_fixes(oom, None)}
    assert fixes["halve"] == 520  # half of the activations and the batch
    assert fixes["activation"] == 500 and fixes["bf16"] == 500
    assert fixes["shard"] == 200  # half of parameters + gradients + optimizer state over 2 devices
    assert fixes["PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True:"] == 1500  # reserved, not in use
    bf16 = {f["fix"].split(" ")[0] for f in oom_fixes({**oom, "dtype": "bfloat16"}, None)}
    assert "bf16" not in bf16  # already in 2 bytes: nothing to gain


H200_OOM = ("CUDA out of memory. Tried to allocate 112.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which "
            "137.11 GiB is free. Including non-PyTorch memory, this process has 2.68 GiB memory in use. 2.00 GiB "
            "allowed; Of the allocated memory 1.78 GiB is allocated by PyTorch, and 169.33 MiB is reserved by PyTorch "
            "but unallocated.")


def test_a_capped_allocator_is_named_as_the_limit_and_other_is_said_in_words():
    # the H200 run: the allocator capped at 2 GiB by set_per_process_memory_fraction; the report said
    # "(the device has 139.8 GiB)" and left "other 609.4 MiB" unexplained (issue 33)
    from gpulab.memory.oom import _CUDA_LIMIT, _CUDA_PROCESS, _bytes
    from gpulab.monitor.analyze.memory_findings import oom_finding
    from gpulab.monitor.events import Recording

    assert _bytes(_CUDA_LIMIT, H200_OOM) == 2 * 2**30
    assert _bytes(_CUDA_PROCESS, H200_OOM) == int(2.68 * 2**30)
    mib = 2**20
    oom = {"type": "oom", "device": "cuda:0", "requested": 112 * mib, "message": H200_OOM.split(".")[0],
           "where": "oom_cuda.py:12", "module": None, "phase": "backward", "batch": 3072, "dtype": "float32",
           "in_use": {"parameters": 320 * mib, "gradients": 0, "optimizer_state": 641 * mib, "activations": 224 * mib,
                      "inputs": 28 * mib, "other": 609 * mib},
           "total_in_use": 1822 * mib, "reserved": 1991 * mib, "device_total": int(139.8 * 2**30),
           "limit": 2 * 2**30, "process_total": int(2.68 * 2**30)}
    evidence = oom_finding(Recording([{"type": "start", "t": 0.0}, oom]))["evidence"]
    assert "the limit hit is the allocator's 2.0 GiB (set_per_process_memory_fraction)" in evidence
    assert "device has" not in evidence
    assert "other is what only autograd's engine holds" in evidence
    assert "the allocator kept 169.0 MiB cached" in evidence and "CUDA context and libraries" in evidence
