"""Training: config dataclasses, recipes, the loop, run directories and checkpoints."""

from gpulab.config import RECIPES, Recipe, TrainConfig
from gpulab.train.build import build
from gpulab.train.loop import train

__all__ = ["RECIPES", "Recipe", "TrainConfig", "build", "train"]
