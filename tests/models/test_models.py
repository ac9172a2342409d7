"""LeNet exactly as the textbook builds it, its initialisation, and ResNet-18 on 28x28 inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpulab import models
from gpulab.errors import UserError
from gpulab.models.layers import ReLUAvgPool2d


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_lenet_layers_are_the_textbooks():
    net = models.LeNet()
    convs = [m for m in net.modules() if isinstance(m, nn.Conv2d)]
    dense = [m for m in net.modules() if isinstance(m, nn.Linear)]
    pools = [m for m in net.modules() if isinstance(m, ReLUAvgPool2d)]
    assert [tuple(c.weight.shape) for c in convs] == [(20, 1, 3, 3), (50, 20, 5, 5)]
    assert all(c.stride == (1, 1) and c.padding == (0, 0) for c in convs)
    assert [tuple(d.weight.shape) for d in dense] == [(128, 800), (10, 128)]
    assert all(m.bias is not None for m in convs + dense)
    assert len(pools) == 1 and pools[0].kernel_size == 2  # stride 2
    assert not any(isinstance(m, nn.MaxPool2d | nn.BatchNorm2d | nn.Dropout) for m in net.modules())
    n_params = sum(p.numel() for p in net.parameters())
    assert n_params == (20 * 9 + 20) + (50 * 20 * 25 + 50) + (800 * 128 + 128) + (128 * 10 + 10)


def test_lenet_activation_shapes():
    net = models.LeNet()
    shapes = []
    hooks = [m.register_forward_hook(lambda m, i, o: shapes.append((type(m).__name__, tuple(o.shape))))
             for m in (net.conv1, net.conv2, net.fc1, net.fc2, net.relu_pool)]
    out = net(torch.randn(3, 1, 28, 28))
    for h in hooks:
        h.remove()
    assert shapes == [
        ("Conv2d", (3, 20, 26, 26)),
        ("ReLUAvgPool2d", (3, 20, 13, 13)),
        ("Conv2d", (3, 50, 9, 9)),
        ("ReLUAvgPool2d", (3, 50, 4, 4)),
        ("Linear", (3, 128)),
        ("Linear", (3, 10)),
    ]
    assert out.shape == (3, 10)


def test_lenet_forward_is_the_textbooks():
    """relu after each conv and the hidden dense layer, average pooling, no activation at the end."""
    net = models.LeNet()
    x = torch.randn(2, 1, 28, 28)
    h = nn.functional.avg_pool2d(torch.relu(net.conv1(x)), 2)
    h = nn.functional.avg_pool2d(torch.relu(net.conv2(h)), 2)
    h = torch.relu(net.fc1(h.reshape(2, 800)))
    torch.testing.assert_close(net(x), net.fc2(h))


def test_lenet_init_textbook():
    torch.manual_seed(0)
    net = models.LeNet().init_textbook()
    weights = torch.cat([m.weight.flatten() for m in (net.conv1, net.conv2, net.fc1, net.fc2)])
    assert abs(weights.std().item() - 0.01) < 0.0005
    assert abs(weights.mean().item()) < 0.0005
    for m in (net.conv1, net.conv2, net.fc1, net.fc2):
        assert abs(m.weight.std().item() - 0.01) < 0.003  # each layer, not just the big fc1
        assert torch.count_nonzero(m.bias) == 0


def test_init_textbook_scale():
    torch.manual_seed(0)
    net = models.LeNet().init_textbook(scale=0.1)
    assert abs(net.fc1.weight.std().item() - 0.1) < 0.005


def test_resnet18_output_shape():
    net = models.ResNet18().eval()
    with torch.no_grad():
        assert net(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    assert models.ResNet18(num_classes=7).eval()(torch.randn(1, 1, 28, 28)).shape == (1, 7)


def test_resnet18_is_resnet18():
    net = models.ResNet18()
    convs = [m for m in net.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    assert len(convs) == 1 + 16  # the stem, then 8 basic blocks of two 3x3 convs
    assert [c.out_channels for c in convs[1::4]] == [64, 128, 256, 512]
    n_params = sum(p.numel() for p in net.parameters())
    assert 11_000_000 < n_params < 11_300_000  # ResNet-18 is ~11.2M with a 10-way head


def test_build():
    assert isinstance(models.build("lenet"), models.LeNet)
    assert isinstance(models.build("resnet18"), models.ResNet18)
    assert models.build("lenet", num_classes=3)(torch.zeros(1, 1, 28, 28)).shape == (1, 3)


def test_build_unknown_model():
    with pytest.raises(UserError, match="--model vgg: unknown model; choose one of lenet, resnet18, or give your own as package.module:factory"):
        models.build("vgg")


@pytest.mark.parametrize("name", ["lenet", "resnet18"])
def test_channels_last_gives_the_same_output(name):
    torch.manual_seed(0)
    net = models.build(name).eval()
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        expected = net(x)
        net = net.to(memory_format=torch.channels_last)
        got = net(x.contiguous(memory_format=torch.channels_last))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
