"""gpulab plan: the ring model's fit, the overlap accounting, the prediction's shape, bad inputs,
and one real (tiny) plan end to end. The predicted-vs-measured check itself is a benchmark
(`gpulab plan --check`, results in benchmarks/results/), not a test: it times things."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time

import psutil
import pytest

from gpulab.io import OUTPUTS_RECORD
from gpulab.plan import collective, netns
from gpulab.plan.links import LINKS, LinkCost, parse_link
from gpulab.plan.peak_memory import fit_line, parse_memory, replicated_peak, sharded_peak
from gpulab.plan.predict import bucket_schedule, exposed_communication, fit_overlap, predict, sharded_communication
from gpulab.plan.profile import StepProfile
from gpulab.plan.render import fits_up_to
from tests.conftest import assert_one_line_error, disk_full_for, run_cli


def ring_seconds(nbytes: float, k: int, alpha: float, beta: float) -> float:
    """The textbook ring allreduce, written out independently of LinkCost."""
    return 2 * (k - 1) * alpha + 2 * (k - 1) / k * nbytes * beta


@pytest.mark.parametrize("k", [2, 4, 8])
def test_fit_recovers_alpha_and_beta_from_exact_timings(k):
    alpha, beta = 25e-6, 1 / 3e9
    sizes = [4096 * 4**i for i in range(7)]
    link = collective.fit(sizes, [ring_seconds(s, k, alpha, beta) for s in sizes], k, "synthetic")
    assert link.alpha_s == pytest.approx(alpha, rel=1e-6)
    assert link.beta_s_per_byte == pytest.approx(beta, rel=1e-6)
    assert link.bandwidth_gbps == pytest.approx(3.0, rel=1e-6)


def test_fit_recovers_alpha_and_beta_through_noise():
    alpha, beta = 200e-6, 1 / 1.25e9
    rng = random.Random(0)
    sizes = [4096 * 2**i for i in range(14)]
    noisy = [ring_seconds(s, 2, alpha, beta) * rng.uniform(0.97, 1.03) for s in sizes]
    link = collective.fit(sizes, noisy, 2, "synthetic")
    assert link.alpha_s == pytest.approx(alpha, rel=0.1)
    assert link.beta_s_per_byte == pytest.approx(beta, rel=0.1)


def test_the_fit_prices_large_messages_at_the_bandwidth_they_get():
    # Small messages slower per byte than large ones (as on a real link): the large ones set beta.
    alpha, beta_large, beta_small = 100e-6, 1 / 90e6, 1 / 20e6
    sizes = [4096 * 4**i for i in range(7)] + [25_000_000]
    seconds = [2 * alpha + s * (beta_large if s >= 1_000_000 else beta_small) for s in sizes]
    link = collective.fit(sizes, seconds, 2, "synthetic")
    assert link.allreduce_s(25_000_000, 2) == pytest.approx(2 * alpha + 25_000_000 * beta_large, rel=0.02)
    assert link.allreduce_s(19_400_000, 2) == pytest.approx(2 * alpha + 19_400_000 * beta_large, rel=0.02)


def test_one_size_that_met_a_busy_moment_does_not_set_the_price():
    # Loopback timings seen here: 64 KiB's median caught a hiccup of the shared machine.
    alpha, beta = 0.2e-3, 1 / 1e9
    sizes = collective.default_sizes(528392)
    seconds = [ring_seconds(s, 2, alpha, beta) for s in sizes]
    seconds[sizes.index(65536)] = 3.2e-3
    link = collective.fit(sizes, seconds, 2, "synthetic")
    assert link.allreduce_s(528392, 2) == pytest.approx(ring_seconds(528392, 2, alpha, beta), rel=0.05)


def test_a_fit_is_never_negative():
    # Timings that fall with size (noise at tiny sizes) must not give a negative latency.
    link = collective.fit([1000, 2000, 4000], [3e-3, 2e-3, 4e-3], 2, "odd")
    assert link.alpha_s >= 0 and link.beta_s_per_byte >= 0


def test_ring_cost_matches_the_formula_and_one_device_costs_nothing():
    link = LinkCost(alpha_s=10e-6, beta_s_per_byte=1e-9, source="t")
    assert link.allreduce_s(1e6, 1) == 0
    assert link.allreduce_s(1e6, 2) == pytest.approx(ring_seconds(1e6, 2, 10e-6, 1e-9))
    assert link.allreduce_s(1e6, 8) == pytest.approx(ring_seconds(1e6, 8, 10e-6, 1e-9))


def profile(ready_ms: list[float], nbytes: list[int], step_ms: float = 100.0, backward_ms: float | None = None,
            times_ms: list[float] | None = None, overlap: float = 1.0) -> StepProfile:
    backward = backward_ms if backward_ms is not None else max(ready_ms)
    return StepProfile(
        batch=64, step_s=step_ms / 1e3, before_backward_s=0.02, backward_s=backward / 1e3,
        after_backward_s=step_ms / 1e3 - 0.02 - backward / 1e3, bucket_bytes=nbytes,
        bucket_ready_s=[r / 1e3 for r in ready_ms], device="cpu", threads=1, copies=1,
        step_times_s=[t / 1e3 for t in (times_ms or [step_ms])], overlap=overlap,
    )


def test_buckets_start_when_ready_and_after_the_one_before():
    # Ready at 10, 20, 30 ms; each takes 12 ms: the second waits for the first, the third for the second.
    schedule = bucket_schedule([0.010, 0.020, 0.030], [0.012, 0.012, 0.012])
    flat = [t for start_end in schedule for t in start_end]
    assert flat == pytest.approx([0.010, 0.022, 0.022, 0.034, 0.034, 0.046])


def test_only_what_runs_past_backward_is_exposed():
    # 1 ms per byte-million: buckets of 5e6 bytes over 2 devices take 2(k-1)/k * 5e6 * 1e-9 = 5 ms each.
    link = LinkCost(alpha_s=0.0, beta_s_per_byte=1e-9, source="t")
    overlapped = profile([10, 20, 30], [5_000_000] * 3)
    assert exposed_communication(overlapped, link, 2) == pytest.approx(0.005)  # only the last one's 5 ms
    at_the_end = profile([30, 30, 30], [5_000_000] * 3)
    assert exposed_communication(at_the_end, link, 2) == pytest.approx(0.015)  # nothing hidden
    hidden = profile([1, 2, 30], [5_000_000, 5_000_000, 0], backward_ms=30)
    assert exposed_communication(hidden, link, 2) == pytest.approx(0.0)
    assert exposed_communication(overlapped, link, 1) == 0


def test_communication_during_backward_goes_at_the_measured_share_of_its_speed():
    # Half speed during a 10 ms backward: a 10 ms allreduce from 0 ms gets 5 ms done, ends at 15 ms.
    assert bucket_schedule([0.0], [0.010], backward_s=0.010, overlap=0.5)[0] == pytest.approx((0.0, 0.015))
    # A quarter speed: a 1 ms bucket takes 4 ms and ends inside backward; the next starts then.
    schedule = bucket_schedule([0.0, 0.001], [0.001, 0.001], backward_s=0.010, overlap=0.25)
    assert [t for se in schedule for t in se] == pytest.approx([0.0, 0.004, 0.004, 0.008])
    # Started after backward: full speed.
    assert bucket_schedule([0.012], [0.003], backward_s=0.010, overlap=0.0)[0] == pytest.approx((0.012, 0.015))
    link = LinkCost(alpha_s=0.0, beta_s_per_byte=1e-9, source="t")
    no_overlap = profile([10, 20, 30], [5_000_000] * 3, overlap=0.0)
    assert exposed_communication(no_overlap, link, 2) == pytest.approx(0.015)  # all three, after backward
    half = profile([10, 20, 30], [5_000_000] * 3, overlap=0.5)
    # Half speed: the first takes 10-20 ms, the second 20-30 ms, the third (after backward) 30-35 ms.
    assert exposed_communication(half, link, 2) == pytest.approx(0.005)


@pytest.mark.parametrize("share", [0.05, 0.13, 0.37, 0.8, 1.0])
def test_the_overlap_fit_recovers_the_share_that_made_the_exposed_time(share):
    # Written out by hand: a 0.5 ms bucket at 5 ms (done by 15 ms at any share >= 0.05), a 100 ms
    # one ready at 20 ms of a 60 ms backward (40 ms at `share` of full speed done by its end,
    # the rest after), then a 30 ms one ready at the end.
    ready, durations, backward = [0.005, 0.020, 0.060], [0.0005, 0.100, 0.030], 0.060
    exposed = (0.100 - share * 0.040) + 0.030
    assert fit_overlap(ready, durations, backward, exposed) == pytest.approx(share, abs=1e-6)


def test_the_overlap_fit_stays_between_none_and_full():
    ready, durations, backward = [0.01], [0.05], 0.03
    assert fit_overlap(ready, durations, backward, 1.0) == 0.0  # more than no overlap at all exposes
    assert fit_overlap(ready, durations, backward, 0.0) == 1.0  # less than full speed exposes


def test_prediction_adds_exposed_communication_to_one_device_s_step():
    link = LinkCost(alpha_s=0.0, beta_s_per_byte=1e-9, source="t")
    p = predict(profile([10, 20, 30], [5_000_000] * 3, step_ms=100), link, 2)
    assert p.step_s == pytest.approx(0.105)
    assert p.samples_per_s == pytest.approx(128 / 0.105)
    assert p.efficiency == pytest.approx(100 / 105)
    assert p.communication_s == pytest.approx(0.015)


def test_sharded_steps_send_each_unit_three_times_and_hide_all_but_the_first_gather():
    """--shard fsdp: per unit, an all-gather in forward, another in backward, a reduce-scatter:
    each (k-1) alpha + (k-1)/k S beta; all but the first gather hide behind forward + backward at
    the measured share of idle speed."""
    link = LinkCost(alpha_s=1e-3, beta_s_per_byte=1e-8, source="test")
    units = [4_000_000, 2_000_000, 0]  # the root holds nothing of its own here
    p = profile([30], [6_000_000], step_ms=60, backward_ms=30, overlap=0.5)  # forward 20 ms + backward 30 ms
    p.unit_bytes = units
    gather = lambda nbytes, k: (k - 1) * 1e-3 + (k - 1) / k * nbytes * 1e-8  # noqa: E731
    got = predict(p, link, 4, sharded=True)
    total = 3 * (gather(4e6, 4) + gather(2e6, 4))
    assert got.communication_s == pytest.approx(total)
    assert got.exposed_s == pytest.approx(gather(4e6, 4) + max(0.0, total - gather(4e6, 4) - 0.5 * 0.050))
    allreduce = predict(p, link, 4).communication_s  # the same 6 MB as one bucket: 2 (k-1)/k S beta
    assert got.communication_s - 6 * 3 * 1e-3 == pytest.approx(1.5 * (allreduce - 2 * 3 * 1e-3))  # 3/2 the bytes
    assert predict(p, link, 1, sharded=True).exposed_s == 0.0


def test_a_measured_sharded_step_is_the_prediction_where_it_was_measured_and_repriced_elsewhere():
    """FSDP's own cost (buffers copied in and out, hooks) is measured, not modelled: on the link
    and k of the copies' measurement the prediction is their sharded step; on a slower link only
    the modelled communication changes."""
    here = LinkCost(alpha_s=2e-4, beta_s_per_byte=5e-9, source="loopback")
    slow = LinkCost(alpha_s=2e-4, beta_s_per_byte=5e-8, source="slow")
    p = profile([30], [6_000_000], step_ms=60, backward_ms=30, overlap=0.5)
    p.unit_bytes, p.copies, p.step_times_s = [4_000_000, 2_000_000, 0], 2, [0.060]
    p.sharded_step_s = 0.150  # far more than the model's communication explains
    assert predict(p, here, 2, sharded=True).step_s == pytest.approx(0.150)
    elsewhere = predict(p, slow, 2, sharded=True, profile_link=here)
    assert elsewhere.step_s - 0.150 == pytest.approx(sharded_communication(p, slow, 2)[1] - sharded_communication(p, here, 2)[1])
    assert elsewhere.step_s > 0.150


def test_prediction_is_monotone_in_bandwidth():
    prof = profile([5, 15, 40], [1_000_000, 20_000_000, 30_000_000], step_ms=120, backward_ms=60)
    speeds = []
    for gbps in [0.01, 0.1, 0.5, 1, 5, 25, 100, 1000]:
        link = LinkCost(alpha_s=20e-6, beta_s_per_byte=1 / (gbps * 1e9), source="t")
        speeds.append([predict(prof, link, k).samples_per_s for k in (2, 4, 8)])
    for k_index in range(3):
        column = [row[k_index] for row in speeds]
        assert all(a <= b for a, b in zip(column, column[1:]))
        assert column[0] < column[-1]  # a slow link costs something


def test_ranks_wait_for_the_slowest_expected_maximum():
    times = [10.0, 11.0, 12.0, 20.0]
    prof = profile([5], [1000], times_ms=times)
    assert prof.expected_slowest_s(1) == pytest.approx(sum(times) / 4 / 1e3)
    # Brute force over every pair of independent draws.
    pairs = [max(a, b) for a, b in itertools.product(times, repeat=2)]
    assert prof.expected_slowest_s(2) == pytest.approx(sum(pairs) / len(pairs) / 1e3)


def test_every_named_link_parses_and_explicit_figures_are_read():
    for name in LINKS:
        assert parse_link(name).bandwidth_gbps == pytest.approx(LINKS[name][0])
    link = parse_link("1.25,30")
    assert link.bandwidth_gbps == pytest.approx(1.25) and link.alpha_s == pytest.approx(30e-6)


@pytest.mark.parametrize("argv, fragments", [
    (["--link", "warp-drive", "--nodes", "2"], ["--link warp-drive", "unknown link", "GB/s,us"]),
    (["--link", "0,5", "--nodes", "2"], ["--link 0,5"]),
    (["--devices-per-node", "0"], ["--devices-per-node 0", "1 or more"]),
    (["--nodes", "0"], ["--nodes 0"]),
    (["--batch-size", "3", "--devices-per-node", "4"], ["--batch-size 3", "4 devices", "at least 4"]),
    (["--nodes", "2"], ["--nodes > 1", "--link"]),
    (["--check", "--check-links", "fast"], ["--check-links fast", "Mbit/s"]),
    (["--check", "--check-links", "inf"], ["--check-links inf", "Mbit/s"]),
    (["--check", "--rounds", "0"], ["--rounds 0"]),
    (["--rounds", "5"], ["--rounds", "add --check"]),
    (["--check-links", "1000"], ["--check-links", "add --check"]),
    (["--check", "--devices-per-node", "1", "--batch-size", "1"], ["--batch-size 1", "2 ranks"]),
    (["--link", "25gbe"], ["--link 25gbe", "--nodes 2"]),
    (["--device-link", "nvlink4", "--devices-per-node", "1"], ["--device-link nvlink4", "--devices-per-node 2"]),
    (["--seconds", "nan", "--no-sweep", "--devices-per-node", "1"], ["--seconds nan"]),
    (["--seconds", "inf", "--no-sweep", "--devices-per-node", "1"], ["--seconds inf"]),
    (["--seconds", "-5", "--no-sweep", "--devices-per-node", "1"], ["--seconds -5"]),
    (["--devices", "cpu*2"], ["--devices cpu*2", "--devices-per-node"]),
    (["--devices-per-node", "1", "64", "--batch-size", "64"], ["--devices-per-node 64", "usable core"]),
    (["--devices", "cpuzzz"], ["cpuzzz"]),
    (["--memory", "0.5"], ["--memory 0.5"]),
    (["--memory", "16i"], ["--memory 16i"]),
    (["--memory", "99999999999999999T"], ["--memory 99999999999999999T"]),
    (["--model", "nosuchmodel"], ["nosuchmodel"]),
    (["--memory", "lots"], ["--memory lots", "80GiB", "16GB", "512MiB"]),
    (["--memory", "0GiB"], ["--memory 0GiB"]),
    (["--model", "nosuch.mod:f", "--no-sweep", "--seconds", "0.1"], ["failed: --model nosuch.mod:f: cannot import"]),
])
def test_bad_inputs_are_one_line_errors(argv, fragments, capsys, tmp_path):
    code, out, err = run_cli(["plan", "--devices", "cpu", "--out", str(tmp_path / "p"), *argv], capsys)
    assert_one_line_error(code, err, *fragments)
    assert "gpulab.errors" not in err  # a measuring process's refusal reads as gpulab's own
    assert not (tmp_path / "p").exists()


def test_a_real_plan_end_to_end(tiny_data, tmp_path, capsys):
    """A tiny plan on this machine: real step profiles and a real gloo measurement."""
    out = tmp_path / "plan"
    code, stdout, err = run_cli(["plan", "--devices", "cpu", "--batch-size", "32", "--seconds", "0.2", "--no-sweep",
                                 "--out", str(out)], capsys)
    assert code == 0, err
    plan = json.loads((out / "plan.json").read_text())
    assert (out / "plan.png").read_bytes().startswith(b"\x89PNG")
    one, two = plan["rows"]
    assert (one["devices"], two["devices"]) == (1, 2)
    assert one["exposed_s"] == 0 and two["communication_s"] > 0
    assert two["step_s"] == pytest.approx(two["compute_s"] + two["exposed_s"])
    assert plan["verdict"] and plan["verdict"][0].startswith("2 devices: ")
    assert "measured: gloo" in plan["links"]["device"]["source"]
    # LeNet's gradient, in the buckets GradSync sends: every parameter (float32) plus one flag each.
    from gpulab import models

    params = list(models.build("lenet").parameters())
    assert sum(plan["profiles"][0]["bucket_bytes"]) == 4 * (sum(p.numel() for p in params) + len(params))
    for p in plan["profiles"]:  # timestamps from hooks, the steps from the clock around them
        assert p["before_backward_s"] > 0 and p["backward_s"] > 0
        # Each step holds its two parts; their medians fit in the longest step (the mean step, a
        # mean, may be shorter than the medians' sum on a noisy machine).
        assert p["before_backward_s"] + p["backward_s"] <= max(p["step_times_s"])
        assert len(p["step_times_s"]) >= 5
        # Copies that ran at once measured what backward hides of an allreduce; one alone did not.
        assert 0 <= p["overlap"] <= 1 and (p["copies"] > 1 or p["overlap"] == 1.0)
    assert [p["copies"] for p in plan["profiles"]] == [1, 2]
    assert "2 devices" in stdout and "Assumptions" in stdout
    words = " ".join(stdout.split())  # the table's caption, wrapped to its width
    assert "measured here: compute and memory at each per-device batch; predicted from them" in words
    # Memory per device from each profile's measured step: half the batch holds less.
    one_memory, two_memory = (p["memory"] for p in plan["profiles"])
    assert two_memory["peak"] < one_memory["peak"] and one_memory["batch"] == 32 and two_memory["batch"] == 16
    assert plan["memory"]["bytes_per_sample"] > 0 and plan["memory"]["fitted_points"] == 2
    # Any batch the 512 training images allow fits in this machine's memory: no batch beyond them is named.
    assert plan["memory_verdict"][0].startswith("memory, one device: ")
    assert "it fits every batch, the whole training set (512 images) included" in plan["memory_verdict"][0]
    assert "sharded over 2" in plan["memory_verdict"][1]
    assert "a device's share of the whole training set (256 of 512 images) included" in plan["memory_verdict"][1]


def test_a_full_disk_is_one_line_and_leaves_no_partial_file(tiny_data, tmp_path, capsys, monkeypatch):
    disk_full_for(monkeypatch, "plan.png")
    out = tmp_path / "plan"
    code, _, err = run_cli(["plan", "--devices", "cpu", "--batch-size", "32", "--seconds", "0.2", "--no-sweep",
                            "--devices-per-node", "1", "--out", str(out)], capsys)
    assert_one_line_error(code, err, f"cannot write {out / 'plan.png'}: No space left on device; "
                                     f"free space or use --out DIR")
    assert sorted(p.name for p in out.iterdir()) == [OUTPUTS_RECORD, "plan.json"]  # whole; no temporary file of plan.png


def test_test_hosts_limit_the_link_and_leave_nothing_behind():
    why = netns.available()
    if why:
        pytest.skip(why)
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    with netns.test_hosts(rate_mbit=50) as hosts:
        timings = collective.measure(2, [64 * 1024, 1024 * 1024], hosts=hosts, timeout_s=120)
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert after == before
    # 1 MiB over 2 ranks: each sends 2(k-1)/k * 1 MiB = 1 MiB; at 50 Mbit/s that takes >= 0.168 s.
    assert timings["seconds"][1] >= 1024 * 1024 * 8 / 50e6
    assert timings["seconds"][1] < 5 * 1024 * 1024 * 8 / 50e6


# ----------------------------------------------------------------------------- memory


def test_memory_sizes_are_read_in_binary_and_decimal_units():
    assert parse_memory("80GiB") == 80 * 2**30
    assert parse_memory("80G") == 80 * 2**30
    assert parse_memory("16GB") == 16 * 10**9
    assert parse_memory("512MiB") == 512 * 2**20
    assert parse_memory("2.5g") == int(2.5 * 2**30)
    assert parse_memory("1024") == 1024


def memory(batch: int, peak: int, **at_peak) -> dict:
    sizes = {"parameters": 100, "gradients": 100, "optimizer_state": 200, "activations": 10 * batch, "inputs": batch}
    return {"peak": peak, "batch": batch, "sizes": sizes, "largest_unit": 30,
            "at_peak": {"optimizer_state": 200, "other_kept": 50, **at_peak}}


def profile_with(m: dict) -> StepProfile:
    return StepProfile(batch=m["batch"], step_s=0.01, before_backward_s=0.0, backward_s=0.0, after_backward_s=0.0,
                       bucket_bytes=[], bucket_ready_s=[], device="cpu", threads=1, copies=1, step_times_s=[0.01],
                       memory=m)


def test_the_largest_batch_is_named_only_below_a_device_s_share_of_the_training_set():
    row = {"train_samples": 1000, "devices": 2}
    assert fits_up_to(499, row) == "it fits up to batch 499 per device"
    assert fits_up_to(500, row).startswith("it fits every batch, a device's share of the whole training set (500 of 1,000")
    assert fits_up_to(501, {"train_samples": 501, "devices": 1}).endswith("(501 images) included")
    assert fits_up_to(10**6, {"train_samples": None, "devices": 1}) == "it fits up to batch 1,000,000 per device"


def test_memory_per_configuration_and_the_largest_batch():
    m = memory(64, 1000)
    assert replicated_peak(m, sync="gpulab") == 1000 and replicated_peak(m, sync="ddp") == 1100  # DDP copies the gradients once
    # Sharded over 4: parameters, gradients and optimizer state (400) / 4, plus the largest unit twice.
    assert sharded_peak(m, 4) == 1000 - 300 + 60
    # FSDP's own buffers, measured on 2 copies (their peak 900 against 1000 - 200 + 60 modelled), added at every k
    assert sharded_peak(m, 2, measured=(2, 900)) == 900 and sharded_peak(m, 4, measured=(2, 900)) == 760 + 40
    line = fit_line([profile_with(memory(64, 1000)), profile_with(memory(32, 600))])
    assert (line.fixed, line.per_sample, line.points) == (200, 12.5, 2)
    assert line.largest_batch(2000) == 144  # (2000 - 200) / 12.5
    assert line.largest_batch(2000, extra=100) == 136
    single = fit_line([profile_with(memory(64, 1000))])  # one batch: all but the state and kept memory grows
    assert (single.fixed, single.points) == (450, 1) and single.per_sample == pytest.approx(550 / 64)


@pytest.mark.slow
@pytest.mark.parametrize("shard", ["none", "fsdp"])
def test_the_memory_check_holds_its_verdict_by_running_it(tiny_data, tmp_path, shard):
    """plan --check's memory part on LeNet: the peak per device of real gpulab train runs (with
    fsdp the 2 ranks shard, and the prediction is the sharded peak with FSDP's buffers as the
    profile's copies measured them), and the largest batch that fits a budget next to 25% more,
    each measured."""
    from gpulab.host import usable_cores
    from gpulab.plan import step
    from gpulab.plan.check import check_memory

    cfg = {"model": "lenet", "batch_size": 64, "devices": "cpu", "data_dir": str(tiny_data), "shard": shard}
    profiles = {"1 process": step.measure(cfg, 64, usable_cores(), seconds=0.2),
                "2 ranks": step.measure(cfg, 32, 1, seconds=0.2, copies=2)}
    result = check_memory(cfg, tiny_data, tmp_path, profiles, say=lambda text: None)
    for row in result["setups"]:
        # sharded: the copies' measured FSDP step is noisier (+8% and +14% in two runs here)
        assert abs(row["error"]) < (0.20 if shard == "fsdp" and row["name"] == "2 ranks" else 0.10), row
    if shard == "none":  # the largest-batch verdict runs replicated either way
        fits, more = result["runs"]
        assert fits["fits"] and not more["fits"], result["runs"]


def test_sigterm_stops_a_plan_in_one_line_and_leaves_no_process_or_temporary_folder(tiny_data, tmp_path):
    """`timeout`, a scheduler or `kill` sends SIGTERM to gpulab alone: its measuring processes and
    their temporary folder go with it."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    gpulab = subprocess.Popen([sys.executable, "-m", "gpulab", "plan", "--devices", "cpu", "--devices-per-node", "1",
                               "--no-sweep", "--seconds", "30", "--batch-size", "32", "--out", str(tmp_path / "plan")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (list(tmp_path.glob("gpulab-plan-*")) and psutil.Process(gpulab.pid).children()):
        assert time.monotonic() < deadline and gpulab.poll() is None, "the plan did not start measuring"
        time.sleep(0.1)
    children = psutil.Process(gpulab.pid).children(recursive=True)
    gpulab.send_signal(signal.SIGTERM)
    _, err = gpulab.communicate(timeout=60)
    assert gpulab.returncode == 143 and err.strip() == "gpulab: error: stopped by SIGTERM", err[-2000:]
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive and not list(tmp_path.glob("gpulab-plan-*")) and not (tmp_path / "plan").exists()


def test_a_speedup_above_the_device_count_says_what_the_measurements_did():
    """2 devices at 2.4x the speed of one (measured under load): no word said it was more than
    two devices can give."""
    from gpulab.plan.planner import Plan
    from gpulab.plan.predict import Prediction
    from gpulab.plan.render import verdict

    one = Prediction(devices=1, nodes=1, global_batch=256, per_device_batch=256, compute_s=0.024, communication_s=0.0,
                     exposed_s=0.0, link="none")
    two = Prediction(devices=2, nodes=1, global_batch=256, per_device_batch=128, compute_s=0.0095,
                     communication_s=0.001, exposed_s=0.0005, link="loopback")
    plan = Plan(config=None, kind="cpu", one_device=one, rows=[one, two], speedups=[1.0, 2.4], sweep={}, links={},
                profiles=[])
    (line,) = verdict(plan)
    assert "2.40x the speed of one at batch 256 - it pays (more than 2x: 128 samples measured 9.5 ms, under 1/2 of " \
           "one device's 24.0 ms" in line and "noise in the measurements" in line
    plan.speedups = [1.0, 1.9]
    assert "more than" not in verdict(plan)[0]


def test_machines_with_several_devices_each_go_as_fast_as_the_slower_hop():
    """2 machines x 2 devices over a fast network: the ring's hops inside each machine are the
    devices' link; the plan priced every hop at the network's (0.027 ms where 1.8 ms was due)."""
    from gpulab.plan.planner import ring_link

    device, network = LinkCost(188e-6, 1 / 1.14e9, "loopback"), LinkCost(5e-6, 1 / 50e9, "ndr400")
    links = {"device": device, "node": network}
    ring = ring_link(links, nodes=2, per_node=2)
    assert (ring.alpha_s, ring.beta_s_per_byte) == (188e-6, 1 / 1.14e9)
    assert ring.allreduce_s(516_304, 4) == pytest.approx(2 * (3 * 188e-6 + 0.75 * 516_304 / 1.14e9))
    assert ring_link(links, nodes=2, per_node=1) is network and ring_link(links, nodes=1, per_node=2) is device
    assert ring_link(links, nodes=1, per_node=1) is None


def test_a_profile_a_busy_machine_spread_out_is_said_to_be_noisy():
    from gpulab.plan.planner import Plan
    from gpulab.plan.render import noise

    def profile(times):
        return StepProfile(batch=256, step_s=sum(times) / len(times), before_backward_s=0.001, backward_s=0.002,
                           after_backward_s=0.001, bucket_bytes=[1000], bucket_ready_s=[0.002], device="cpu",
                           threads=2, step_times_s=times, copies=1, unit_bytes=[])

    quiet, busy = profile([0.040, 0.041, 0.042, 0.043, 0.044]), profile([0.037, 0.040, 0.041, 0.45, 0.8])
    plan = Plan(config=None, kind="cpu", one_device=None, rows=[], speedups=[], sweep={}, links={}, profiles=[quiet])
    assert noise(plan) == []
    plan.profiles = [busy]
    (line,) = noise(plan)
    assert line.startswith("noisy measurement: at batch 256 (1 at once) the 5 steps took 37.0-800.0 ms (median 41.0, "
                           "mean 273.6)")


def test_a_sweep_point_past_k_devices_is_no_batch_that_pays():
    """The sweep said 2 devices 'would pay from a global batch of 8' on a 13.98x point (a profile's
    noise) and stopped there; such a point neither pays nor ends the sweep."""
    from gpulab.plan.planner import Plan, SweepPoint
    from gpulab.plan.predict import Prediction

    def point(batch, speedup):
        return SweepPoint(Prediction(devices=2, nodes=1, global_batch=2 * batch, per_device_batch=batch,
                                     compute_s=0.01, communication_s=0.0, exposed_s=0.0, link="x"), speedup)

    plan = Plan(config=None, kind="cpu", one_device=None, rows=[], speedups=[], links={}, profiles=[],
                sweep={(1, 2): [point(4, 13.98), point(16, 0.9), point(64, 1.4)]})
    assert plan.smallest_paying_batch(1, 2) == 128
