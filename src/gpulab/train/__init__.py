"""Training: config dataclasses, recipes, the loop, run directories and checkpoints."""

from gpulab.train.config import RECIPES, Recipe, TrainConfig
from gpulab.train.loop import build, train

__all__ = ["RECIPES", "Recipe", "TrainConfig", "build", "train"]
