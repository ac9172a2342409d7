"""k-device training equals 1-device training (the guarantee gpulab states)."""

import pytest
import torch
from torch import nn

from gpulab.cli import main
from gpulab.devices import resolve
from gpulab.models import LeNet
from gpulab.parallel.parity import FLOAT64_TOLERANCE, max_parameter_difference

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
        (torch.randn(batch_size, 1, 28, 28, generator=g), torch.randint(0, 10, (batch_size,), generator=g))
        for _ in range(num_steps)
    ]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("batch_size", [24, 23])  # even and uneven shards
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("model", ["lenet", "batchnorm"])
def test_parity_float64(k, batch_size, optimizer, model):
    torch.manual_seed(0)
    net = LeNet() if model == "lenet" else small_bn_net()
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    diff = max_parameter_difference(net, resolve(f"cpu*{k}"), batches(batch_size), loss_fn, OPTIMIZERS[optimizer])
    assert diff <= FLOAT64_TOLERANCE


@pytest.mark.parametrize("algorithm", ["naive", "ring"])
def test_parity_float32_lenet(algorithm):
    torch.manual_seed(0)
    diff = max_parameter_difference(
        LeNet(), resolve("cpu*3"), batches(25), nn.functional.cross_entropy, OPTIMIZERS["sgd-momentum"],
        dtype=torch.float32, allreduce=algorithm,
    )
    assert diff <= 1e-5


def test_per_device_batchnorm_is_not_parity(monkeypatch):
    """The control: without sync BN the k-device run really is a different computation."""
    from gpulab.parallel import DataParallel

    torch.manual_seed(0)
    net = small_bn_net().double()
    single = DataParallel(net, resolve("cpu"), optimizer=OPTIMIZERS["adam"])
    multi = DataParallel(net, resolve("cpu*2"), optimizer=OPTIMIZERS["adam"], sync_bn=False)
    for X, y in batches(24):
        single.train_step(X.double(), y, nn.functional.cross_entropy)
        multi.train_step(X.double(), y, nn.functional.cross_entropy)
    diff = max((p - q).abs().max().item() for p, q in zip(single.module.parameters(), multi.module.parameters()))
    assert diff > 1e-6


def test_check_parity_cli(tiny_data, capsys):
    assert main(["train", "--devices", "cpu*3", "--batch-size", "32", "--check-parity"]) == 0
    out = capsys.readouterr().out
    assert "parity PASS" in out and "float64" in out
