"""The diagnosis rules on hand-made recordings: the arithmetic of diagnose.py, no timing involved.

GPU *behaviour* (that syncs are detected, kernels counted) is tested in test_gpu.py on a GPU; here
recordings that describe a CUDA run check only that the rules rank and bound the causes right.
"""

from __future__ import annotations

import pytest

from gpulab.monitor.alive.stall import find_stalls
from gpulab.monitor.analyze.diagnose import diagnose
from gpulab.monitor.analyze.findings import FIXES, MIN_SHARE
from gpulab.monitor.analyze.step_costs import lane_summary, select_steady
from gpulab.monitor.events import CATEGORIES, PASS_START_COUNT, PASSES_COUNT, Recording

GPU = {"index": 0, "name": "Test GPU", "uuid": "GPU-1234", "memory_total_mib": 80000.0, "gpm": False}


def steps(n: int, **ms) -> list[dict]:
    """n identical steps; keyword arguments are milliseconds per category (and counts)."""
    counts = {k: v for k, v in ms.items() if k not in CATEGORIES}
    excl = {c: ms.get(c, 0.0) / 1e3 for c in CATEGORIES}
    length = sum(excl.values())
    out, t = [], 100.0
    for i in range(n):
        out.append({"type": "step", "i": i, "t0": t, "t1": t + length, "excl": dict(excl), "counts": dict(counts),
                    "profiled": False, "data": []})
        t += length
    return out


def recording(step_records, cuda: bool = False, extra: list[dict] | None = None, hot: dict | None = None,
              hot_steps: dict | None = None) -> Recording:
    """`hot`'s lines sampled in every step, unless `hot_steps` says in how many."""
    records = [{"type": "start", "t": 99.0, "torch": "2.x", "torch_cuda_build": "12.6" if cuda else None, "cpu_count": 8}]
    records += step_records
    records += extra or []
    hot = hot or {}
    in_steps = hot_steps or {c: {where: len(step_records) for where in lines} for c, lines in hot.items()}
    records.append({"type": "hot", "interval_s": 0.02, "lines": hot, "steps": in_steps})
    devices = [{"index": 0, "name": "Test GPU", "uuid": "1234"}] if cuda else []
    records.append({"type": "end", "t": 1e9, "exit_code": 0, "error": None,
                    "cuda": {"available": cuda, "initialized": cuda, "devices": devices}})
    return Recording(records)


def causes(report: dict) -> list[str]:
    return [f["cause"] for f in report["findings"]]


def test_cpu_input_bound_is_input_pipeline_with_its_share():
    rec = recording(steps(20, data_wait=30, compute=8, other=2),
                    extra=[{"type": "loader", "where": "train.py:40", "dataset": "Slow", "batch_size": 16,
                            "num_workers": 0, "pin_memory": False, "persistent_workers": False}],
                    hot={"data_wait": {"data.py:12": 30, "train.py:40": 3}})
    report = diagnose(rec, [], [], warmup_steps=2)
    top = report["findings"][0]
    assert top["cause"] == "input_pipeline"
    assert top["share"] == pytest.approx(0.75, abs=1e-3)
    assert top["where"] == "data.py:12"  # the hottest line while waiting, not the loop line
    assert "num_workers" in top["fix"]
    assert report["phases"]["data_wait"] == pytest.approx(0.75, abs=1e-3)
    assert sum(report["phases"].values()) == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize(("ranks_here", "spare"), [(None, "7 core(s) are spare"), (2, "3 core(s) are spare"),
                                                   (8, None)])
def test_spare_cores_count_every_rank_on_the_machine(ranks_here, spare):
    # 8 cores, one torch thread per rank: a lone process leaves 7 for workers; two torchrun ranks,
    # each wanting its own workers, leave 3 each; eight ranks leave none (found by running
    # kubeflow's mnist.py, 2 ranks on 2 cores: "1 core(s) are spare" was wrong).
    rec = recording(steps(20, data_wait=30, compute=8, other=2),
                    extra=[{"type": "loader", "where": "train.py:40", "dataset": "Slow", "batch_size": 16,
                            "num_workers": 0, "pin_memory": False, "persistent_workers": False}])
    rec.start.update(torch_threads=1, local_world_size=ranks_here)
    fix = diagnose(rec, [], [], warmup_steps=2)["findings"][0]["fix"]
    if spare:
        assert spare in fix
    else:
        assert "no sure win" in fix and "are spare" not in fix


def test_cpu_compute_bound_with_a_fast_pipeline_reports_nothing():
    report = diagnose(recording(steps(20, data_wait=0.8, compute=40, other=1)), [], [], warmup_steps=2)
    assert causes(report) == ["none"]
    assert report["findings"][0]["where"] is None


def busy_loop(math: dict | None, compiled: bool = False) -> str:
    facts = [{"type": "facts", "math": math}] if math else []
    compiles = [_compiled(99.0, 99.5, "0/0")] if compiled else []
    report = diagnose(recording(steps(20, data_wait=0.8, compute=40, other=1), extra=facts + compiles), [], [],
                      warmup_steps=2)
    assert causes(report) == ["none"]
    return report["findings"][0]["fix"]


def test_a_busy_loop_is_told_the_cheaper_math_it_does_not_use_yet():
    native = {"device": "cpu", "autocast": None, "channels_last": False, "bf16_native": True}
    assert busy_loop(native) == ("the loop keeps the device busy; to go faster make the math cheaper (mixed "
                                 "precision: bf16 autocast, channels_last, torch.compile) or use more devices "
                                 "(gpulab train --devices ...)")
    used = busy_loop({**native, "autocast": "bfloat16", "channels_last": True})
    assert "make the math cheaper (torch.compile)" in used and used.endswith("it uses bfloat16 autocast, channels_last already")
    assert busy_loop({**native, "autocast": "bfloat16", "channels_last": None}, compiled=True) == (
        "the loop keeps the device busy; to go faster use more devices (gpulab train --devices ...); it uses "
        "bfloat16 autocast, torch.compile already")
    # a CPU that emulates bf16 is told not to use it; no 4-D weights: no channels_last
    emulated = busy_loop({**native, "channels_last": None, "bf16_native": False})
    assert "make the math cheaper (torch.compile)" in emulated and "mixed precision" not in emulated
    assert emulated.endswith("not bf16: this CPU has no native bf16, and torch would emulate it (~3x slower)")
    assert busy_loop(None) == FIXES["none"]  # not recorded: every way


def test_operator_lines_count_as_compute_and_a_python_line_stays():
    """The operators window timed 6 ms a step of torch functions at the forward's line (train.py:10)
    and none at the loop's Python (train.py:20); 'other' is 8 ms a step, three quarters of its
    samples at the forward."""
    records = steps(60, compute=4, other=8)
    for s in records[2:5]:
        s["profiled"] = True
    facts = {"type": "facts", "ops_window_steps": [2, 3, 4], "ops_lines": {"train.py:10": 0.018}}
    spans = {"type": "spans", "seconds": {"torch operators outside modules": 0.018}}
    rec = recording(records, extra=[facts, spans], hot={"other": {"train.py:10": 0.36, "train.py:20": 0.12}})
    report = diagnose(rec, [], [], warmup_steps=2)
    assert report["phases"]["compute"] == pytest.approx((4 + 6) / 12, abs=0.01)
    assert lane_summary(rec, warmup_steps=2)["phases"] == report["phases"]  # the process's own line says the same
    assert report["operators_outside_modules"]["lines"] == ["train.py:10"]
    top = report["findings"][0]
    assert top["cause"] == "low_device_utilization" and top["where"] == "train.py:20"


def epochs_with_worker_starts(persistent: bool) -> Recording:
    """4 epochs of 5 steps (20 ms data wait, 10 ms compute); each epoch's first step waits 3 s for
    its loader's 4 workers to start (the first epoch's start is paid whatever the settings)."""
    records = steps(20, data_wait=20, compute=10)
    t = 100.0
    for r in records:
        if r["i"] % 5 == 0:
            r["excl"]["data_wait"] = 3.0
            r["counts"] = {PASS_START_COUNT: 3.0, PASSES_COUNT: 1}
        r["t0"], r["t1"] = t, t + sum(r["excl"].values())
        t = r["t1"]
    loader = {"type": "loader", "where": "train.py:40", "dataset": "Images", "batch_size": 64, "num_workers": 4,
              "pin_memory": True, "persistent_workers": persistent}
    return recording(records, extra=[loader])


def test_workers_that_restart_every_epoch_get_persistent_workers_advice():
    report = diagnose(epochs_with_worker_starts(persistent=False), [], [], 2)
    restart = next(f for f in report["findings"] if f["fix"] == FIXES["input_pipeline_restart"])
    # 3 restarts of 3 s, less a batch's usual 20 ms each, over 16 x 30 ms + 4 x 3.01 s of training
    assert restart["share"] == pytest.approx((3 * 2.98) / (16 * 0.03 + 4 * 3.01), abs=1e-3)
    assert restart["share_of"] == "the training time" and restart["where"] == "train.py:40"
    assert "3 passes" in restart["evidence"]
    # the long steps are explained: no stall of the job's
    assert find_stalls([epochs_with_worker_starts(persistent=False)], 2, [], 100.0) == []


def test_persistent_workers_that_start_once_get_no_restart_advice():
    report = diagnose(epochs_with_worker_starts(persistent=True), [], [], 2)
    assert not any(f["fix"] == FIXES["input_pipeline_restart"] for f in report["findings"])


def test_python_between_steps_on_cpu_is_low_device_utilization_at_the_hot_line():
    rec = recording(steps(20, compute=5, other=15), hot={"other": {"train.py:77": 40}})
    report = diagnose(rec, [], [], warmup_steps=2)
    assert causes(report) == ["low_device_utilization"]
    assert report["findings"][0]["where"] == "train.py:77"
    assert report["findings"][0]["share"] == pytest.approx(0.75, abs=1e-3)


def test_a_cost_of_every_step_is_placed_at_a_line_that_runs_every_step():
    """A job that ran once between two steps outweighs the loop's line in samples, but was sampled
    in one step: the per-step cost is the loop's; with only such lines, it is placed nowhere, and
    the support says so."""
    hot = {"other": {"train.py:30": 40, "train.py:77": 12}}
    rec = recording(steps(20, compute=5, other=15), hot=hot, hot_steps={"other": {"train.py:30": 1, "train.py:77": 18}})
    assert diagnose(rec, [], [], warmup_steps=2)["findings"][0]["where"] == "train.py:77"
    rec = recording(steps(20, compute=5, other=15), hot={"other": {"train.py:30": 40}}, hot_steps={"other": {"train.py:30": 2}})
    top = diagnose(rec, [], [], warmup_steps=2)["findings"][0]
    assert top["cause"] == "low_device_utilization" and top["where"] is None
    assert "not placed at a line" in top["support"]


def renumbered(step_records: list[dict]) -> list[dict]:
    """Steps built in pieces, as one run: consecutive numbers and times."""
    t = 100.0
    for i, s in enumerate(step_records):
        s["i"], s["t0"], s["t1"] = i, t, t + (s["t1"] - s["t0"])
        t = s["t1"]
    return step_records


def test_python_near_the_threshold_in_part_of_the_run_is_held_back():
    # 12% other Python on average, 5% in the first quarter: within the run's own spread of the
    # threshold, so the next run may well say the opposite (the DDP tutorial: named in 2 of 4 runs)
    rec = recording(renumbered(steps(7, compute=19, other=1) + steps(21, compute=86, other=14)))
    report = diagnose(rec, [], [], warmup_steps=2)
    assert report["phases"]["other"] > MIN_SHARE
    assert "low_device_utilization" not in causes(report)


def test_python_every_few_steps_above_the_threshold_in_every_quarter_is_a_finding():
    # a costly log line every 4th step: 0% in most steps, 25% overall, alike in each quarter
    pattern = steps(3, compute=10) + steps(1, compute=10, other=13.3)
    rec = recording(renumbered([dict(s) for _ in range(10) for s in pattern]), hot={"other": {"train.py:9": 12}})
    report = diagnose(rec, [], [], warmup_steps=2)
    assert causes(report) == ["low_device_utilization"]
    assert "across the run's quarters" in report["findings"][0]["evidence"]


def test_cuda_sync_that_exposes_host_work_is_ranked_first():
    # Per step: 4 ms of Python (other), 1 ms launching, 5 ms blocked in .item(); the kernels take
    # 5 ms, so the device idles 5 of 10 ms. Without the sync the host's 5 ms would hide under the
    # device's 5 ms: the sync is the cause, the Python is not (it would be free).
    kernels = {"type": "kernels", "steps": 3, "kernels_per_step": 30, "kernel_median_us": 150.0,
               "kernel_p90_us": 400.0, "device_busy_s_per_step": 0.005, "memcpy_pageable_per_step": 0,
               "runtime_sync_s_per_step": 0.005}
    sites = {"type": "sites", "sites": [{"kind": "sync", "where": "train.py:50", "ops": ["Tensor.item"],
                                         "count": 20, "seconds": 0.1, "untimed": 0, "bytes": 0}]}
    rec = recording(steps(20, compute=1, sync=5, other=4, sync_count=1), cuda=True, extra=[kernels, sites])
    report = diagnose(rec, [], [GPU], warmup_steps=2)
    assert causes(report) == ["host_sync"]
    assert report["findings"][0]["share"] == pytest.approx(0.5, abs=1e-3)
    assert report["findings"][0]["where"] == "train.py:50"


def test_cuda_sync_on_a_saturated_device_is_not_a_finding():
    # The same .item() every step, but the device is busy 9.8 of 10 ms: the sync costs nothing.
    kernels = {"type": "kernels", "steps": 3, "kernels_per_step": 30, "kernel_median_us": 300.0,
               "kernel_p90_us": 900.0, "device_busy_s_per_step": 0.0098, "memcpy_pageable_per_step": 0,
               "runtime_sync_s_per_step": 0.008}
    rec = recording(steps(20, compute=1.5, sync=8, other=0.5, sync_count=1), cuda=True, extra=[kernels])
    report = diagnose(rec, [], [GPU], warmup_steps=2)
    assert causes(report) == ["none"]


def test_a_saturated_device_s_host_split_is_said_to_cost_nothing():
    # A whole step replayed as one CUDA graph (H200, 2026-11-27): the device busy ~100% of a 0.3 ms
    # step, while the host's split read "data wait 51%" - where it waited for a full launch queue.
    kernels = {"type": "kernels", "steps": 3, "kernels_per_step": 40, "kernel_median_us": 5.0,
               "kernel_p90_us": 9.0, "device_busy_s_per_step": 0.00029, "memcpy_pageable_per_step": 0,
               "runtime_sync_s_per_step": 0.0}
    rec = recording(steps(20, data_wait=0.15, other=0.15), cuda=True, extra=[kernels])
    (top,) = diagnose(rec, [], [GPU], warmup_steps=2)["findings"]
    assert top["cause"] == "none"
    assert "data wait 50%" in top["evidence"] and "cost nothing then" in top["evidence"]
    # with the device idle a third of the step, the same split is the cause
    kernels["device_busy_s_per_step"] = 0.0002
    rec = recording(steps(20, data_wait=0.15, other=0.15), cuda=True, extra=[kernels])
    assert causes(diagnose(rec, [], [GPU], warmup_steps=2))[0] == "input_pipeline"


def _compiled(t0: float, t1: float, compile_id: str) -> dict:
    return {"type": "compile", "kind": "compile", "t0": t0, "t1": t1, "compile_id": compile_id, "trigger": "dynamo",
            "function": None, "where": "train.py:9", "reason": None, "defined_at": None}


@pytest.mark.parametrize("n_steps", [0, 3])
def test_torch_compile_s_causes_are_named_however_few_steps_the_run_had(n_steps):
    # A short compiled script (Lightning's 4 steps, all in the warm-up, or a crash before the first
    # step): the loop cannot be judged, what compiling cost the run can. Under a framework the
    # script's line into the compiled code is trainer.fit: the recompiled function's line is said too.
    recompile = {"type": "compile", "kind": "recompile", "t0": 102.1, "t1": 102.1, "compile_id": "0/1", "trigger": None,
                 "function": "training_step", "where": "train.py:9", "defined_at": "model.py:20",
                 "reason": "tensor 'batch[0]' size mismatch at index 0. expected 64, actual 8"}
    rec = recording(steps(n_steps, compute=5), extra=[_compiled(100.0, 102.0, "0/0"), recompile,
                                                      _compiled(102.1, 103.0, "0/1")])
    report = diagnose(rec, [], [], warmup_steps=5)
    assert "none" not in causes(report)
    (found,) = [f for f in report["findings"] if f["cause"] == "recompile"]
    assert found["where"] == "train.py:9" and "the compiled training_step (model.py:20) called here" in found["evidence"]
    assert "drop_last=True" in found["fix"]


@pytest.mark.parametrize("guard, fix", [
    ("self.config.problem_type is None", "set it once before the first call"),  # HF's model, under Trainer
    ("self.sizes == set()", "keep per-step Python state out of the compiled function"),  # state kept in training_step
    ("tensor 'x' size mismatch at index 0. expected 64, actual 8; self.sizes == {64}", "mark_dynamic"),  # the size first
    ("self.lr == 0.1", "pass it as a tensor"),  # a number: its own rule
    ("self.training == True", "switched between train() and eval()"),
])
def test_a_recompile_on_a_module_attribute_says_to_set_it_once(guard, fix):
    recompile = {"type": "compile", "kind": "recompile", "t0": 102.1, "t1": 102.1, "compile_id": "0/1", "trigger": None,
                 "function": "forward", "where": "train.py:9", "defined_at": "model.py:20", "reason": guard}
    rec = recording(steps(20, compute=5), extra=[_compiled(100.0, 102.0, "0/0"), recompile])
    (found,) = [f for f in diagnose(rec, [], [], warmup_steps=2)["findings"] if f["cause"] == "recompile"]
    assert fix in found["fix"]


def test_a_cuda_graph_recorded_again_is_named_with_what_moved_and_the_fix():
    rerecord = {"type": "compile", "kind": "cudagraph_rerecord", "t0": 104.0, "t1": 104.0, "compile_id": None,
                "trigger": None, "function": "forward", "where": "train.py:30", "defined_at": None,
                "reason": "static input data pointer changed (primals_2)"}
    rec = recording(steps(20, compute=5), cuda=True, extra=[_compiled(100.0, 102.0, "0/0"), rerecord, dict(rerecord)])
    (found,) = [f for f in diagnose(rec, [], [GPU], warmup_steps=2)["findings"] if f["cause"] == "cudagraph_rerecord"]
    assert found["where"] == "train.py:30" and "recorded again 2 times: static input data pointer changed" in found["evidence"]
    assert "p.copy_(new)" in found["fix"]


def test_cuda_many_tiny_kernels_is_launch_overhead():
    kernels = {"type": "kernels", "steps": 3, "kernels_per_step": 900, "kernel_median_us": 3.0,
               "kernel_p90_us": 6.0, "device_busy_s_per_step": 0.003, "memcpy_pageable_per_step": 0,
               "runtime_sync_s_per_step": 0.0}
    rec = recording(steps(20, compute=9, other=1), cuda=True, extra=[kernels], hot={"compute": {"model.py:20": 9}})
    report = diagnose(rec, [], [GPU], warmup_steps=2)
    assert report["findings"][0]["cause"] == "launch_overhead"
    assert report["findings"][0]["where"] == "model.py:20"
    assert report["findings"][0]["share"] == pytest.approx(0.7, abs=1e-3)  # host 10 ms vs device 3 ms: 7 ms exposed


def test_cuda_pageable_copies_are_h2d_copy():
    sites = {"type": "sites", "sites": [{"kind": "h2d_pageable", "where": "train.py:33", "ops": ["Tensor.to"],
                                         "count": 40, "seconds": 0.24, "untimed": 0, "bytes": 40 * 2**26}]}
    kernels = {"type": "kernels", "steps": 3, "kernels_per_step": 30, "kernel_median_us": 100.0,
               "kernel_p90_us": 200.0, "device_busy_s_per_step": 0.004, "memcpy_pageable_per_step": 2,
               "runtime_sync_s_per_step": 0.006}
    rec = recording(steps(20, h2d=6, compute=2, other=0.5, h2d_pageable=2, h2d_pageable_bytes=2**27),
                    cuda=True, extra=[sites, kernels])
    report = diagnose(rec, [], [GPU], warmup_steps=2)
    assert report["findings"][0]["cause"] == "h2d_copy"
    assert report["findings"][0]["where"] == "train.py:33"
    assert "pin_memory=True" in report["findings"][0]["fix"]


def test_cuda_blocking_copies_from_pinned_memory_are_h2d_copy_with_the_non_blocking_fix():
    # pin_memory=True without non_blocking=True: the host waits for every copy, as from pageable
    # memory (torch's sync debug mode reports these copies; pinned + non_blocking is not reported).
    sites = {"type": "sites", "sites": [{"kind": "h2d_pinned_blocking", "where": "train.py:41", "ops": ["Tensor.to"],
                                         "count": 40, "seconds": 0.24, "untimed": 0, "bytes": 40 * 2**26}]}
    kernels = {"type": "kernels", "steps": 3, "kernels_per_step": 30, "kernel_median_us": 100.0,
               "kernel_p90_us": 200.0, "device_busy_s_per_step": 0.002, "memcpy_pageable_per_step": 0,
               "runtime_sync_s_per_step": 0.0}
    rec = recording(steps(20, h2d=6, compute=2, other=0.5, h2d_pinned_blocking=1, h2d_pinned_blocking_bytes=2**26),
                    cuda=True, extra=[sites, kernels])
    top = diagnose(rec, [], [GPU], warmup_steps=2)["findings"][0]
    assert (top["cause"], top["where"]) == ("h2d_copy", "train.py:41")
    assert "without non_blocking=True" in top["evidence"]
    assert "pinned already" in top["fix"] and "non_blocking=True" in top["fix"]


def test_async_copies_from_pinned_memory_are_no_finding():
    kernels = {"type": "kernels", "steps": 3, "kernels_per_step": 30, "kernel_median_us": 300.0,
               "kernel_p90_us": 600.0, "device_busy_s_per_step": 0.0085, "memcpy_pageable_per_step": 0,
               "runtime_sync_s_per_step": 0.0}
    rec = recording(steps(20, h2d=0.05, compute=8.5, other=0.5, h2d_pinned=1, h2d_pinned_bytes=2**26),
                    cuda=True, extra=[kernels])
    assert "h2d_copy" not in causes(diagnose(rec, [], [GPU], warmup_steps=2))


def _nvml_rows(**per_gpu) -> list[dict]:
    return [{"t": 100.0 + i, "gpus": [dict(per_gpu)], "proc": None} for i in range(20)]


def test_without_a_kernel_window_the_job_s_own_nvml_share_is_preferred_to_the_device_wide_one():
    # A shared GPU: another process keeps it 90% busy; this job's processes use 30% of its SMs.
    rec = recording(steps(20, compute=5, other=5), cuda=True)
    report = diagnose(rec, _nvml_rows(kernel_active_pct=90.0, process_sm_pct=30.0), [GPU], warmup_steps=2)
    assert report["device_busy"]["share"] == pytest.approx(0.30, abs=0.01)
    assert report["device_busy"]["source"].startswith("NVML per-process")


def test_the_device_wide_nvml_share_says_it_is_device_wide():
    rec = recording(steps(20, compute=5, other=5), cuda=True)
    report = diagnose(rec, _nvml_rows(kernel_active_pct=90.0), [GPU], warmup_steps=2)
    assert report["device_busy"]["share"] == pytest.approx(0.90, abs=0.01)
    assert "device-wide" in report["device_busy"]["source"]


def test_gpu_present_but_unused_is_cpu_only_torch():
    report = diagnose(recording(steps(20, compute=40, other=1)), [], [GPU], warmup_steps=2)
    assert causes(report)[0] == "cpu_only_torch"
    assert "CPU-only build" in report["findings"][0]["evidence"]


def test_findings_are_ranked_and_above_the_threshold():
    rec = recording(steps(20, data_wait=12, compute=10, other=6), hot={"other": {"t.py:1": 5}})
    report = diagnose(rec, [], [], warmup_steps=2)
    shares = [f["share"] for f in report["findings"]]
    assert causes(report) == ["input_pipeline", "low_device_utilization"]
    assert shares == sorted(shares, reverse=True) and min(shares) >= MIN_SHARE


def test_no_steps_gives_a_report_that_says_so():
    report = diagnose(recording([]), [], [], warmup_steps=2)
    assert report["steps"] == 0
    assert causes(report) == ["none"]
    assert "no training step" in report["findings"][0]["evidence"]


def test_steady_steps_leave_out_warmup_profiled_and_epoch_boundaries():
    records = steps(30, compute=10)
    for s in records[5:8]:
        s["profiled"] = True
    records[20]["t1"] = records[20]["t0"] + 5.0  # evaluation at an epoch boundary
    steady, excluded = select_steady(records, warmup_steps=2)
    assert excluded == {"warmup": 2, "profiler_window": 3, "compiling": 0, "outliers": 1}
    assert len(steady) == 30 - 2 - 3 - 1


def test_the_copy_line_is_the_one_the_steps_wait_at_not_the_set_up_copy():
    # pinned_blocking_copy.py on the H200: the model's one .to(device) at set-up (pageable, and
    # paying for CUDA's start-up: 0.5 s) outweighed 30 per-step copies of 4 ms in seconds.
    sites = {"type": "sites", "sites": [
        {"kind": "h2d_pageable", "where": "pinned_blocking_copy.py:20", "ops": ["Tensor.to"], "count": 2,
         "seconds": 0.5, "untimed": 0, "bytes": 2**20, "steady_count": 0, "steady_seconds": 0.0},
        # and a set-up copy of the steps' own kind (a pinned table copied once, blocking)
        {"kind": "h2d_pinned_blocking", "where": "pinned_blocking_copy.py:21", "ops": ["Tensor.to"], "count": 1,
         "seconds": 0.4, "untimed": 0, "bytes": 2**28, "steady_count": 0, "steady_seconds": 0.0},
        {"kind": "h2d_pinned_blocking", "where": "pinned_blocking_copy.py:25", "ops": ["Tensor.to"], "count": 30,
         "seconds": 0.12, "untimed": 0, "bytes": 30 * 2**26, "steady_count": 28, "steady_seconds": 0.11}]}
    kernels = {"type": "kernels", "steps": 3, "kernels_per_step": 30, "kernel_median_us": 100.0,
               "kernel_p90_us": 200.0, "device_busy_s_per_step": 0.002, "memcpy_pageable_per_step": 0,
               "runtime_sync_s_per_step": 0.0}
    rec = recording(steps(20, h2d=4, compute=2, other=0.5, h2d_pinned_blocking=1, h2d_pinned_blocking_bytes=2**26),
                    cuda=True, extra=[sites, kernels])
    top = diagnose(rec, [], [GPU], warmup_steps=2)["findings"][0]
    assert (top["cause"], top["where"]) == ("h2d_copy", "pinned_blocking_copy.py:25")


def died_after_training(cuda_records: list[dict]) -> Recording:
    """A CUDA job that trained (rule records, steps) and died at exit: no end record, and the
    whole-run snapshot written before its first backward (facts say 0 calls)."""
    records = [{"type": "start", "t": 99.0, "torch": "2.x", "torch_cuda_build": "13.0", "cpu_count": 16},
               {"type": "facts", "step_rule": None, "backward_calls": 0, "optimizer_steps": 0},
               {"type": "rule", "rule": "optimizer"}]
    records += cuda_records + steps(40, compute=2, other=4, sync=5, sync_count=1)
    return Recording(records)


def test_a_job_that_died_never_reads_as_cpu_only_or_untrained():
    usage = {"type": "cuda", "available": True, "initialized": True, "sync_debug_mode": True,
             "devices": [{"index": 0, "name": "Test GPU", "uuid": "1234"}]}
    report = diagnose(died_after_training([usage]), [], [GPU], warmup_steps=2)
    assert "cpu_only_torch" not in causes(report)
    assert report["steps_found"] == "found from optimizer.step()"
    assert report["device_busy"]["source"] != "cpu"
    assert report["not_measured"] and "the window did not run" in report["not_measured"][0]


def test_a_job_that_died_before_saying_whether_it_used_the_gpu_is_not_called_cpu_only():
    rec = died_after_training([])
    rec._rule = None  # not even the rule record reached the file
    report = diagnose(rec, [], [GPU], warmup_steps=2)
    assert "cpu_only_torch" not in causes(report)
    assert "inference-only" not in report["steps_found"] and "no training" not in report["steps_found"]
    assert any("whether the script used the GPU" in m for m in report["not_measured"])


def test_a_job_that_said_it_used_no_gpu_is_cpu_only_torch():
    rec = recording(steps(20, compute=40, other=1), cuda=False)
    rec.start["torch_cuda_build"] = "13.0"  # a CUDA build, and the end record names no device
    report = diagnose(rec, [], [GPU], warmup_steps=2)
    assert causes(report)[0] == "cpu_only_torch" and "never put work on it" in report["findings"][0]["evidence"]


def test_a_run_with_no_step_outside_warm_up_and_windows_draws_no_loop_finding():
    # out_of_memory under a 2 GiB cap on the H200: 2 warm-up steps, 4 in the kernel and memory
    # windows, then the error; the warm-up's CUDA start-up read as "Python between the calls 91%".
    records = steps(6, compute=2, other=40)
    for s in records[2:]:
        s["profiled"] = True
    report = diagnose(recording(records, cuda=True), [], [GPU], warmup_steps=2)
    assert causes(report) == ["none"]
    assert "no step after the warm-up" in report["findings"][0]["evidence"]
