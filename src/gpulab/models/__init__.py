"""Models gpulab trains: the textbook's LeNet and a ResNet-18 for 28x28 images."""

from torch import nn

from gpulab.errors import UserError
from gpulab.models.lenet import LeNet
from gpulab.models.resnet import ResNet18

MODELS = {"lenet": LeNet, "resnet18": ResNet18}


def build(name: str, num_classes: int = 10) -> nn.Module:
    try:
        return MODELS[name](num_classes=num_classes)
    except KeyError:
        raise UserError(f"unknown model '{name}': choose one of {', '.join(MODELS)}") from None


__all__ = ["MODELS", "LeNet", "ResNet18", "build"]
