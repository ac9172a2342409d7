"""Models gpulab trains: the textbook's LeNet, a ResNet-18 for 28x28 images, or the user's own.

A model is named by a spec: `lenet`, `resnet18`, or `package.module:factory` - a callable that
takes no arguments and returns an nn.Module (what `gpulab train --model` takes). A model passed to
`gpulab.train.train(model=...)` as an object is recorded as `custom`: it cannot be rebuilt from
the run directory, so resuming such a run takes the object again.
"""

import importlib
import inspect
import os
import re
import sys

from torch import nn

from gpulab.errors import UserError
from gpulab.models.lenet import LeNet
from gpulab.models.resnet import ResNet18

MODELS = {"lenet": LeNet, "resnet18": ResNet18}
OBJECT = "custom"  # the spec recorded for a model passed as an nn.Module


_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_NAME = re.compile(r"[A-Za-z_]\w*")


def is_factory(spec: str) -> bool:
    """`package.module:factory`: a module's dotted import name (not a file path), a name in it."""
    module, sep, attr = spec.partition(":")
    return bool(sep and _DOTTED.fullmatch(module) and _NAME.fullmatch(attr))


def check_spec(spec: str) -> None:
    if spec not in MODELS and spec != OBJECT and not is_factory(spec):
        raise UserError(f"--model {spec}: unknown model; choose one of {', '.join(MODELS)}, "
                        "or give your own as package.module:factory (import names, not a file path)")


def check_named(spec: str | None) -> None:
    """A --model the user typed: `custom` is gpulab's record of a model passed as an object."""
    if spec == OBJECT:
        raise UserError(f"--model {OBJECT}: gpulab's record of a model passed to train() as an object; here give "
                        f"{', '.join(MODELS)} or your own as package.module:factory")


def build(spec: str, num_classes: int = 10) -> nn.Module:
    check_spec(spec)
    if spec in MODELS:
        return MODELS[spec](num_classes=num_classes)
    if spec == OBJECT:
        raise UserError("this run's model was passed to gpulab.train.train() as an object, so it cannot be rebuilt "
                        "from the run directory: pass it again (train(..., model=...))")
    return from_factory(spec)


def from_factory(spec: str) -> nn.Module:
    """`package.module:factory()`. The working directory is searched last, as `python -m` would."""
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"--model {spec}: cannot import {module_name} ({e}); run from the folder that holds it, "
                        "or put it on PYTHONPATH") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UserError(f"--model {spec}: {module_name} has no callable {attr}; name a function or class that "
                        "returns an nn.Module")
    try:
        inspect.signature(factory).bind()  # gpulab calls it with no arguments
    except TypeError as e:
        raise UserError(f"--model {spec}: {attr}() cannot be called without arguments ({e}); name a function that "
                        "builds the model with none, e.g. def my_model(): return Net(num_classes=10)") from None
    except ValueError:  # no signature to read (a builtin): the call says
        pass
    model = factory()
    if not isinstance(model, nn.Module):
        raise UserError(f"--model {spec}: {attr}() returned an object of type {type(model).__name__}, not a torch.nn.Module")
    check_trainable(model, f"--model {spec}: the model {attr}() built")
    return model


def check_trainable(model: nn.Module, named: str) -> None:
    """An optimizer needs parameters to step (torch.optim refuses an empty list with a traceback)."""
    if not any(p.requires_grad for p in model.parameters()):
        raise UserError(f"{named} has no parameter that requires a gradient: nothing to train; give it layers with "
                        "weights (nn.Linear, nn.Conv2d, ...)")


__all__ = ["MODELS", "OBJECT", "LeNet", "ResNet18", "build", "check_spec", "is_factory"]


def has_batchnorm(module: nn.Module) -> bool:
    """Any BatchNorm layer (per-device or gpulab's synchronized one, a subclass)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())
