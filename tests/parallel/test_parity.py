"""k devices in one process compute what plain PyTorch computes on one model (gpulab's guarantee).

The reference here is plain PyTorch written in this file: one model, `opt.zero_grad();
loss_fn(model(X), y).backward(); opt.step()` per batch, nothing of gpulab in it.
"""

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from gpulab.cli import main
from gpulab.errors import UserError
from gpulab.devices import resolve
from gpulab.models import LeNet
from gpulab.parallel import DataParallel
from gpulab.parallel.parity import FLOAT64_TOLERANCE, max_difference, reference_training
from gpulab.train.step import Trainer

_spec = importlib.util.spec_from_file_location("dist_worker", Path(__file__).with_name("dist_worker.py"))
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
}


def small_bn_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 6, 5), nn.BatchNorm2d(6), nn.ReLU(), nn.AvgPool2d(2),
        nn.Conv2d(6, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
        nn.Flatten(), nn.Linear(32, 10),
    )


def batches(batch_size: int, num_steps: int = 4):
    g = torch.Generator().manual_seed(batch_size)
    return [
        (torch.randn(batch_size, 1, 28, 28, generator=g, dtype=torch.float64), torch.randint(0, 10, (batch_size,), generator=g))
        for _ in range(num_steps)
    ]


def plain_pytorch(model, data, loss_fn, optimizer) -> nn.Module:
    model = copy.deepcopy(model)
    opt = optimizer(model.parameters())
    for X, y in data:
        opt.zero_grad()
        loss_fn(model(X), y).backward()
        opt.step()
    return model


def max_diff(reference: nn.Module, dp: DataParallel) -> float:
    return max(
        (p - q).abs().max().item()
        for replica in dp.replicas
        for p, q in zip(replica.parameters(), reference.parameters())
    )


def data_parallel(model, data, loss_fn, optimizer, k, accumulate=1, **options) -> DataParallel:
    dp = DataParallel(copy.deepcopy(model), resolve(f"cpu*{k}"), optimizer=optimizer, **options)
    trainer = Trainer(dp, loss_fn, accumulate=accumulate)
    for X, y in data:
        trainer.train_step(X, y)
    return dp


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("batch_size", [24, 23])  # even and uneven shards
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("model", ["lenet", "batchnorm"])
def test_parity_float64(k, batch_size, optimizer, model):
    torch.manual_seed(0)
    net = (LeNet() if model == "lenet" else small_bn_net()).double()
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    data = batches(batch_size)
    reference = plain_pytorch(net, data, loss_fn, OPTIMIZERS[optimizer])
    # Plain PyTorch normalizes over the whole batch: with BatchNorm that is sync BN.
    dp = data_parallel(net, data, loss_fn, OPTIMIZERS[optimizer], k, sync_bn=model == "batchnorm")
    assert max_diff(reference, dp) <= 1e-9


def bn_variant(kind: str) -> nn.Module:
    """A small net whose BatchNorm is each kind --sync-bn must synchronize as torch's BatchNorm
    computes it on the whole batch."""
    flat = {"1d": lambda: nn.BatchNorm1d(32), "1d momentum None": lambda: nn.BatchNorm1d(32, momentum=None)}
    if kind in flat:
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 32), flat[kind](), nn.ReLU(), nn.Linear(32, 10))
    if kind == "3d":
        return nn.Sequential(nn.Unflatten(1, (1, 1)), nn.Conv3d(1, 4, (1, 3, 3)), nn.BatchNorm3d(4), nn.ReLU(),
                             nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(4, 10))
    bn = {"2d momentum None": lambda: nn.BatchNorm2d(6, momentum=None),
          "2d untracked": lambda: nn.BatchNorm2d(6, track_running_stats=False)}[kind]
    return nn.Sequential(nn.Conv2d(1, 6, 5), bn(), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(24, 10))


@pytest.mark.parametrize("kind", ["1d", "1d momentum None", "3d", "2d momentum None", "2d untracked"])
def test_sync_bn_of_every_batchnorm_kind_is_plain_pytorch(kind):
    """--sync-bn synchronized nn.BatchNorm2d only (a BatchNorm1d stayed per replica, silently),
    used momentum 0.1 where momentum=None asks for a cumulative average, and failed without
    running statistics: weights and running statistics now equal plain PyTorch's for each."""
    torch.manual_seed(0)
    net = bn_variant(kind).double()
    data = batches(24)
    loss_fn = nn.functional.cross_entropy
    reference = plain_pytorch(net, data, loss_fn, OPTIMIZERS["sgd-momentum"])
    dp = data_parallel(net, data, loss_fn, OPTIMIZERS["sgd-momentum"], 2, sync_bn=True)
    assert max_diff(reference, dp) <= 1e-9
    states = reference.state_dict(), dp.replicas[0].state_dict()
    assert states[0].keys() == states[1].keys()
    assert max((states[0][k].double() - states[1][k].double()).abs().max().item() for k in states[0]) <= 1e-9


def test_sync_bn_refuses_a_batchnorm_of_its_own_kind():
    class MyNorm(nn.BatchNorm2d):
        def forward(self, x):
            return super().forward(x) * 2

    net = nn.Sequential(nn.Conv2d(1, 6, 5), MyNorm(6), nn.Flatten(), nn.Linear(6 * 24 * 24, 10)).double()
    with pytest.raises(UserError, match="--sync-bn: MyNorm is a BatchNorm of its own kind"):
        data_parallel(net, batches(24, 1), nn.functional.cross_entropy, OPTIMIZERS["sgd-momentum"], 2, sync_bn=True)


@pytest.mark.parametrize("k", [2, 3])
def test_a_learning_rate_schedule_set_each_step_is_plain_pytorch_s(k):
    """The trainer sets the learning rate every step (Trainer.set_lr); plain PyTorch
    sets it on its one optimizer's param_groups."""
    torch.manual_seed(0)
    net = LeNet().double()
    data = batches(24)
    rates = [0.05, 0.02, 0.08, 0.01]
    loss_fn = nn.functional.cross_entropy
    model = copy.deepcopy(net)
    opt = OPTIMIZERS["sgd-momentum"](model.parameters())
    for lr, (X, y) in zip(rates, data):
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        loss_fn(model(X), y).backward()
        opt.step()
    dp = DataParallel(copy.deepcopy(net), resolve(f"cpu*{k}"), optimizer=OPTIMIZERS["sgd-momentum"])
    trainer = Trainer(dp, loss_fn)
    for lr, (X, y) in zip(rates, data):
        trainer.set_lr(lr)
        trainer.train_step(X, y)
    assert max_diff(model, dp) <= 1e-9


@pytest.mark.parametrize("k,accumulate", [(1, 3), (2, 2), (3, 3)])
def test_accumulation_equals_the_whole_batch(k, accumulate):
    torch.manual_seed(0)
    net = LeNet().double()
    data = batches(24, num_steps=3)
    reference = plain_pytorch(net, data, nn.functional.cross_entropy, OPTIMIZERS["sgd-momentum"])
    dp = data_parallel(net, data, nn.functional.cross_entropy, OPTIMIZERS["sgd-momentum"], k, accumulate=accumulate)
    assert max_diff(reference, dp) <= 1e-9


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_unused_parameters_are_skipped_like_plain_pytorch(optimizer, k):
    """Weight decay would move a parameter that plain PyTorch skips (its .grad is None)."""
    net = worker.make_model("branchy")
    data = worker.make_batches("branchy", 12, 8)
    reference = plain_pytorch(net, data, nn.functional.cross_entropy, worker.OPTIMIZERS[optimizer])
    dp = data_parallel(net, data, nn.functional.cross_entropy, worker.OPTIMIZERS[optimizer], k)
    assert max_diff(reference, dp) <= 1e-9
    assert torch.equal(dp.module.unused.weight, net.unused.weight)  # never touched
    assert not torch.equal(dp.module.body.weight, net.body.weight)  # and the rest did train


@pytest.mark.parametrize("k", [1, 2])
def test_frozen_layers_stay_frozen_like_plain_pytorch(k):
    torch.manual_seed(0)
    net = LeNet().double()
    for p in net.conv1.parameters():  # fine-tuning: the first convolution is frozen
        p.requires_grad_(False)
    data = batches(24, num_steps=3)
    reference = plain_pytorch(net, data, nn.functional.cross_entropy, OPTIMIZERS["sgd-momentum"])
    dp = data_parallel(net, data, nn.functional.cross_entropy, OPTIMIZERS["sgd-momentum"], k)
    assert max_diff(reference, dp) <= 1e-9
    assert torch.equal(dp.module.conv1.weight, net.conv1.weight)


@pytest.mark.parametrize("algorithm", ["naive", "ring"])
def test_parity_float32_lenet(algorithm):
    torch.manual_seed(0)
    net = LeNet()
    data = [(X.float(), y) for X, y in batches(25)]
    reference = plain_pytorch(net, data, nn.functional.cross_entropy, OPTIMIZERS["sgd-momentum"])
    dp = data_parallel(net, data, nn.functional.cross_entropy, OPTIMIZERS["sgd-momentum"], 3, allreduce=algorithm)
    assert max_diff(reference, dp) <= 1e-5


def test_per_device_batchnorm_is_not_parity():
    """The control: without sync BN the k-device run really is a different computation."""
    torch.manual_seed(0)
    net = small_bn_net().double()
    data = batches(24)
    reference = plain_pytorch(net, data, nn.functional.cross_entropy, OPTIMIZERS["adam"])
    dp = data_parallel(net, data, nn.functional.cross_entropy, OPTIMIZERS["adam"], 2, sync_bn=False)
    assert max_diff(reference, dp) > 1e-6


def test_the_parity_reference_measures_parity_and_its_absence():
    """gpulab.parallel.parity's reference and difference (what --check-parity uses) on k devices."""
    torch.manual_seed(0)
    net, loss_fn = LeNet().double(), nn.functional.cross_entropy
    reference = reference_training(net, batches(24), loss_fn, OPTIMIZERS["adam"])
    dp = data_parallel(net, batches(24), loss_fn, OPTIMIZERS["adam"], 3)
    assert max_difference(reference.parameters(), dp.module.parameters()) <= FLOAT64_TOLERANCE

    def twice(params):  # an optimizer that steps twice: what parity must catch
        opt = OPTIMIZERS["adam"](params)
        step = opt.step
        opt.step = lambda *a, **kw: (step(*a, **kw), step(*a, **kw))[0]
        return opt

    reference = plain_pytorch(net.double(), batches(24), loss_fn, OPTIMIZERS["adam"])
    dp = data_parallel(net.double(), batches(24), loss_fn, twice, 3)
    assert max_diff(reference, dp) > 1e-4


def test_check_parity_cli(tiny_data, capsys):
    assert main(["train", "--devices", "cpu*3", "--batch-size", "32", "--check-parity"]) == 0
    out = capsys.readouterr().out
    assert "parity PASS" in out
    assert "plain PyTorch on one model vs [cpu*3]" in out


def test_check_parity_states_the_float32_yardstick_it_measured(tiny_data, capsys):
    assert main(["train", "--devices", "cpu*2", "--batch-size", "32", "--check-parity"]) == 0
    out = capsys.readouterr().out
    assert "(plain PyTorch vs itself, samples reordered: " in out
    assert "what reordering the samples alone changes" in out


@pytest.mark.parametrize(("sync_bn", "verdict"), [
    (["--sync-bn"], "parity PASS: float64 difference <= 1e-09"),
    ([], "parity not expected: per-device BatchNorm (no --sync-bn)"),
    (["--sync-bn", "--accumulate", "2"], "parity not expected: --accumulate 2: BatchNorm normalizes each micro-batch "
                                         "with its own statistics, unlike one model on the whole batch"),
])
def test_check_parity_checks_the_batchnorm_mode_asked_for(tiny_data, capsys, sync_bn, verdict):
    # Per-device BN is not one model's BN: it must be reported as such, not quietly checked with
    # sync-BN switched on; with --sync-bn the check runs (it used to end in a pickling traceback).
    # Batches of 4 (2 per device): 5 float64 steps of ResNet-18 are most of the time.
    code = main(["train", "--model", "resnet18", "--devices", "cpu*2", "--batch-size", "4", *sync_bn, "--check-parity"])
    out = capsys.readouterr().out
    assert code == 0 and verdict in out
