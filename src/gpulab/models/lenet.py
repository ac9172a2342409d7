"""LeNet exactly as the textbook's multi-GPU chapter builds it from scratch.

conv 20@3x3 -> ReLU -> avgpool 2 -> conv 50@5x5 -> ReLU -> avgpool 2 -> dense 800->128 -> ReLU
-> dense 128->10.  On a 28x28 input: 26x26 -> 13x13 -> 9x9 -> 4x4, and 50*4*4 = 800. Each ReLU
and pooling after a convolution is one layer (ReLUAvgPool2d): the same numbers, a cheaper backward.
"""

from __future__ import annotations

import torch
from torch import nn

from gpulab.models.layers import ReLUAvgPool2d


class LeNet(nn.Module):
    def __init__(self, num_classes: int = 10, in_channels: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 20, kernel_size=3)
        self.conv2 = nn.Conv2d(20, 50, kernel_size=5)
        self.fc1 = nn.Linear(800, 128)
        self.fc2 = nn.Linear(128, num_classes)
        self.relu_pool = ReLUAvgPool2d(2)
        # In place: the linear layer before it needs its input, not its output, for its gradient,
        # so the ReLU may overwrite that output: one tensor less.
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu_pool(self.conv1(x))
        x = self.relu_pool(self.conv2(x))
        x = torch.flatten(x, 1)
        x = self.relu(self.fc1(x))
        return self.fc2(x)

    @torch.no_grad()
    def init_textbook(self, scale: float = 0.01) -> "LeNet":
        """The chapter's initialisation: every weight ~ N(0, scale^2), every bias 0."""
        for m in (self.conv1, self.conv2, self.fc1, self.fc2):
            m.weight.normal_(0.0, scale)
            m.bias.zero_()
        return self
