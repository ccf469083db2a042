"""``cnn_tiny``: a small CNN for CPU runs and tests (images of at least 8x8)."""
from __future__ import annotations

import torch
from torch import nn

from trainables.models.registry import register_model

class TinyCNN(nn.Module):
    """Three-conv CNN for CPU tests and laptop smoke runs; not from any paper."""

    def __init__(self, num_classes: int, width: int = 32):
        super().__init__()
        layers, cin = [], 3
        for cout, stride in [(width, 1), (2 * width, 2), (4 * width, 2)]:
            layers += [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
            cin = cout
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean((2, 3)))


@register_model("cnn_tiny")
def cnn_tiny(num_classes: int) -> nn.Module:
    return TinyCNN(num_classes)
