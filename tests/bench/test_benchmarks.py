"""The logic inside the benchmarks: which devices they pick, what they compare, how they summarize."""

from __future__ import annotations

import pytest
import torch

from gpulab import bench
from gpulab.bench import allreduce, concurrency, input_pipeline, matmul, scaling, vectorize
from gpulab.bench.runner import Context
from gpulab.errors import UserError

CPU, G0, G1 = torch.device("cpu"), torch.device("cuda:0"), torch.device("cuda:1")


def _row(device, dtype, n, seconds):
    return {"device": device, "dtype": dtype, "n": n, "time": {"median_s": seconds}, "gflops": 2 * n**3 / seconds / 1e9}


def test_matmul_crossover_is_where_the_gpu_wins_from_then_on():
    rows = [_row("cpu", "fp32", n, t) for n, t in ((16, 1e-6), (64, 1e-5), (256, 1e-3), (1024, 1e-1))]
    # the GPU wins at 64 by noise, loses at 256, wins for good from 1024
    rows += [_row("cuda:0", "fp32", n, t) for n, t in ((16, 1e-5), (64, 5e-6), (256, 2e-3), (1024, 1e-3))]
    rows += [_row("cuda:0", "bf16", 1024, 1e-4)]
    summary = matmul.summarize(rows)
    assert summary["gpu_fp32_faster_from_n"] == {"cuda:0": 1024}
    assert summary["peak_gflops"]["cuda:0 bf16"]["n"] == 1024
    assert "beats the CPU from n=1024" in summary["headline"]


def test_matmul_cpu_only_has_no_crossover():
    summary = matmul.summarize([_row("cpu", "fp32", 16, 1e-6)])
    assert summary["gpu_fp32_faster_from_n"] == {}
    assert summary["headline"].startswith("CPU fp32 peaks")


def test_allreduce_ks():
    assert allreduce.ks_for(1) == []
    assert allreduce.ks_for(2) == [2]
    assert allreduce.ks_for(3) == [2, 3]
    assert allreduce.ks_for(6) == [2, 4, 6]
    assert allreduce.ks_for(8) == [2, 4, 8]


def test_allreduce_device_pools():
    cfg = bench.config(allreduce, "tiny")
    assert allreduce.device_sets(cfg, Context(devices=[CPU] * 3)) == [[CPU] * 3]
    # a lone 'cpu' has nothing to reduce: it stands for the default virtual replicas
    assert allreduce.device_sets(cfg, Context(devices=[CPU])) == [[CPU] * cfg.cpu_replicas]
    assert allreduce.device_sets(cfg, Context(devices=[G0, G1])) == [[G0, G1]]
    assert allreduce.device_sets(cfg, Context(devices=[G0])) == []  # one GPU: skipped, with a reason


def test_concurrency_setups():
    modes = lambda devices: [m for m, _, _ in concurrency.setups(Context(devices=devices))]  # noqa: E731
    assert modes([G0, G1]) == ["two devices", "two streams"]
    assert modes([G0]) == ["two streams"]
    assert modes([CPU]) == ["two threads"]
    assert modes([G0, CPU]) == ["two streams", "two threads"]


def test_scaling_pool():
    cfg = bench.config(scaling, "tiny")
    assert scaling.pool(cfg, Context(devices=[CPU])) == [CPU] * cfg.cpu_replicas
    assert scaling.pool(cfg, Context(devices=[G0, G1])) == [G0, G1]
    assert scaling.pool(cfg, Context(devices=[CPU] * 3)) == [CPU] * 3


def test_context_devices_and_reasons():
    assert Context(devices=[CPU, CPU]).single_devices() == [CPU]
    assert Context(devices=[G0, CPU, G0]).gpus() == [G0]
    if not torch.cuda.is_available():
        assert Context().gpus() == []
        if torch.version.cuda is None:
            assert Context().no_gpu_reason() == f"no GPU: this torch ({torch.__version__}) is a CPU-only build"
        else:
            assert "no CUDA GPU visible to torch" in Context().no_gpu_reason()


def test_one_hot_ways_agree():
    seg = torch.randint(0, 80, (2, 9, 7))
    ways = vectorize.one_hot_ways(seg, 80)
    masks = {name: fn() for name, fn in ways.items()}
    reference = masks.pop("loop over classes")
    assert reference.shape == (2, 80, 9, 7) and reference.sum() == 2 * 9 * 7  # exactly one class per pixel
    for name, m in masks.items():
        assert torch.equal(m, reference), name


def test_padded_masked_loss_equals_the_per_image_loop():
    cfg = bench.config(vectorize, "tiny")
    logits, targets = vectorize.variable_batch(cfg, CPU)
    assert len({tuple(t.shape) for t in targets}) > 1  # really different sizes
    loop = vectorize.loss_loop(logits, targets)
    padded = vectorize._padded_as_loop(vectorize.pad_batch(logits, targets), logits)
    for a, b in zip(loop, padded):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_permute_ways_agree():
    x = torch.randn(2, 4, 3, 5)
    weights = [torch.randn(4, 4) for _ in range(2)]
    for task, ways in vectorize.permute_ways(x, weights).items():
        a, b = (fn() for fn in ways.values())
        for u, v in zip(a, b):
            torch.testing.assert_close(u, v), task


def test_input_pipeline_falls_back_to_synthetic_data(monkeypatch):
    def missing(*args, **kwargs):
        raise UserError("Fashion-MNIST not found")

    monkeypatch.setattr(input_pipeline.data, "load", missing)
    split, source = input_pipeline.dataset(40)
    assert source.startswith("synthetic")
    assert split.images.shape == (40, 1, 28, 28) and split.images.dtype == torch.uint8
    assert split.labels.max() < 10


def test_input_pipeline_uses_the_dataset_when_present(tiny_data):
    split, source = input_pipeline.dataset(32)
    assert source.startswith("fashion-mnist") and len(split) == 32


@pytest.mark.parametrize("name", ["full", "quick", "tiny"])
def test_every_benchmark_has_each_preset(name):
    from gpulab import bench

    for benchmark in bench.BENCHMARKS:
        module = bench.load(benchmark)
        cfg = bench.config(module, name)
        assert module.LESSON and callable(module.run) and callable(module.plot)
        assert isinstance(cfg, module.Config)


def test_gloo_ranks_in_threads_sum_exactly():
    from gpulab.bench.result import Result

    cfg = bench.config(allreduce, "tiny")
    result = Result(name="t", lesson="", config={}, env={}, preset="tiny")
    ranks = allreduce._gloo_ranks(3, result)
    if ranks is None:
        pytest.skip(f"gloo unavailable: {result.skipped}")
    try:
        t = ranks.time(cfg, result, 4096)
    finally:
        ranks.close()
    assert result.checks[-1].passed and t.median_s > 0


def test_training_floor_counts_lenet_s_multiply_adds_from_its_layers():
    from gpulab.bench import training

    # conv1 26x26x20x(1x3x3), conv2 9x9x50x(20x5x5), fc 800x128 and 128x10; x2 FLOPs, x3 with backward
    macs = 26 * 26 * 20 * 9 + 9 * 9 * 50 * 20 * 25 + 800 * 128 + 128 * 10
    assert training.training_flops_per_sample() == 6 * macs


def test_training_ratios_are_round_by_round_against_the_textbook():
    from gpulab.bench import training
    from gpulab.bench.result import Result

    result = Result(name="training", lesson="", config={}, env={}, preset="tiny")
    table = result.table("training", "", [])
    runs = {training.TEXTBOOK: [training.figures(20, [9, 9], [1, 1], 0, 0.8), training.figures(20, [6, 6], [1, 1], 0, 0.8)],
            training.DEFAULT: [training.figures(5, [2, 2], [0.5, 0.5], 0, 0.9), training.figures(10, [3, 3], [0.5, 0.5], 0, 0.9)]}
    rows = training._rows(table, "cpu", training.FIRST, runs, epochs=2)
    assert rows[training.DEFAULT]["ratio_min"] == 2.0 and rows[training.DEFAULT]["ratio_max"] == 4.0
    assert rows[training.DEFAULT]["ratio"] == 3.0  # 20/5 and 20/10: the whole processes' seconds, round by round
    assert (rows[training.DEFAULT]["wall_s"], rows[training.DEFAULT]["wall_s_min"], rows[training.DEFAULT]["wall_s_max"]) == (7.5, 5, 10)
    assert rows[training.DEFAULT]["epoch_s"] == 3.75  # the median of 2.5 and 5 s per epoch
    assert rows[training.DEFAULT]["train_ratio"] == 3.25  # 9/2 and 6/3, round by round: not 7.5/2.5
    assert (rows[training.DEFAULT]["train_ratio_min"], rows[training.DEFAULT]["train_ratio_max"]) == (2.0, 4.5)


def test_a_run_s_rest_is_its_process_outside_the_epochs_and_compiling():
    from gpulab.bench import training

    run = training.figures(30.0, train=[5.0, 4.0, 4.0], evaluation=[1.0, 0.5, 0.5], compile_s=3.0, test_acc=0.9)
    assert run["rest_s"] == 12.0  # 30 - 13 training - 2 evaluation - 3 compiling
    assert (run["train_s"], run["eval_s"], run["epochs"]) == (4.0, 0.5, 3)


def test_the_textbook_s_training_seconds_leave_its_evaluation_out(tiny_data, monkeypatch):
    """gpulab train's train_seconds exclude evaluation; the textbook's must too, or the per-epoch
    ratio flatters gpulab (on the H200 the textbook's figure included it until this test). A
    clock that an evaluation advances by 100 s tells where the evaluation was counted."""
    from gpulab.bench import textbook

    clock = {"offset": 0.0}
    real = textbook.time.perf_counter
    monkeypatch.setattr(textbook.time, "perf_counter", lambda: real() + clock["offset"])

    def slow_accuracy(*args):
        clock["offset"] += 100.0
        return 0.5

    monkeypatch.setattr(textbook, "accuracy", slow_accuracy)
    monkeypatch.setattr(textbook, "WORKERS", 0)  # the tiny set in-process: the clock is what is tested
    told = textbook.main(2, "cpu")
    assert all(s < 100 for s in told["train_seconds"]) and all(s >= 100 for s in told["eval_seconds"])
    assert len(told["train_seconds"]) == len(told["eval_seconds"]) == 2 and told["test_acc"] == [0.5, 0.5]


def test_the_textbook_reports_its_first_step_and_each_epoch_s_end_since_its_start(tiny_data, monkeypatch):
    """The moments `gpulab train` writes in its metrics.json, from the textbook's port too, on the
    same clock: seconds since the process was created (gpulab.host.seconds_since_start)."""
    from gpulab.bench import textbook

    clock = iter(range(100, 200))
    monkeypatch.setattr(textbook, "seconds_since_start", lambda: float(next(clock)))
    accuracies = iter([0.7, 0.8])
    monkeypatch.setattr(textbook, "accuracy", lambda *args: next(accuracies))
    monkeypatch.setattr(textbook, "WORKERS", 0)
    told = textbook.main(2, "cpu")
    # read once after the first batch, then once after each epoch's evaluation
    assert (told["first_step_s"], told["wall_s"], told["test_acc"]) == (100.0, [101.0, 102.0], [0.7, 0.8])


@pytest.mark.parametrize("native", [True, False])
def test_training_floor_in_bf16_only_where_the_device_has_it(monkeypatch, native):
    """Without native bf16 (AVX2 only) torch emulates it: a 2048 matmul took 213 s there. The floor
    then has no bf16 row, and says why."""
    from gpulab.bench import training
    from gpulab.bench.result import Result

    measured, kernels = [], []
    monkeypatch.setattr(training, "native_bf16", lambda device: native)
    monkeypatch.setattr(training, "peak_flops", lambda device, dtype: measured.append(dtype) or 1e11)
    monkeypatch.setattr(training, "kernel_floor", lambda device, dtype, samples: kernels.append(dtype) or
                        {"batch": 256, "channels_last": True, "step_s": 0.01, "epoch_s": 1.0})
    result = Result(name="training", lesson="", config={}, env={}, preset="tiny")
    floor = training._floor(result, torch.device("cpu"), samples=1000)
    assert measured == kernels == ([torch.float32, torch.bfloat16] if native else [torch.float32])
    assert ("bf16" in floor) is native and floor["fp32"]["epoch_s"] == pytest.approx(1000 * training.training_flops_per_sample() / 1e11)
    assert any("no native bf16" in note for note in result.notes) is not native


def test_kernel_floor_takes_lenet_s_layers_as_a_step_calls_them():
    """The shapes a step's convolutions and linear layers see, and the first one's input (the data)
    needs no gradient - its backward is the weight's alone."""
    from gpulab.bench import training

    calls = training.kernel_calls(training.models.build("lenet"), batch=8)
    assert [(tuple(c.input_shape), c.input_needs_grad) for c in calls] == [
        ((8, 1, 28, 28), False), ((8, 20, 13, 13), True), ((8, 800), True), ((8, 128), True)]


def test_kernel_floor_times_each_layer_s_forward_and_the_gradients_backward_computes(monkeypatch):
    from gpulab.bench import training
    from gpulab.bench.harness import Timing

    timed = []

    def fake_measure(fn, devices, **kwargs):
        timed.append(fn())
        return Timing(median_s=0.001, iqr_s=0.0, min_s=0.001, max_s=0.001, repeats=5, inner=1, clock="wall")

    monkeypatch.setattr(training, "measure", fake_measure)
    floor = training.kernel_floor(torch.device("cpu"), torch.float32, samples=1000)
    # 4 layers x (forward + backward) at 1 ms each, 3 full batches of 256 in 1000 samples
    assert floor["step_s"] == pytest.approx(0.008) and floor["epoch_s"] == pytest.approx(0.024)
    assert floor["batch"] == 256 and floor["channels_last"]  # gpulab train's choices on a CPU
    conv1_out, conv1_grads, conv2_out, conv2_grads = timed[:4]
    assert conv1_out.shape == (256, 20, 26, 26) and conv1_out.is_contiguous(memory_format=torch.channels_last)
    assert [g.shape for g in conv1_grads] == [(20, 1, 3, 3), (20,)]  # weight, bias: no gradient for the data
    assert [g.shape for g in conv2_grads] == [(256, 20, 13, 13), (50, 20, 5, 5), (50,)]
