"""Wide ResNets (pre-activation, Zagoruyko and Komodakis): ``wrn28_2`` (1.47M parameters), ``wrn28_8``."""
from __future__ import annotations

import torch
from torch import nn

from trainables.models.registry import register_model
from trainables.models.segmented_bn import bn_relu

class PreActBlock(nn.Module):
    """Pre-activation WRN block (Zagoruyko & Komodakis, arXiv:1605.07146)."""

    def __init__(self, cin: int, cout: int, stride: int, dropout: float):
        super().__init__()
        self.bn1, self.bn2 = nn.BatchNorm2d(cin), nn.BatchNorm2d(cout)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Conv2d(cin, cout, 1, stride, 0, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = bn_relu(self.bn1, x)
        # On a shape change the shortcut sees the activated input (original WRN code).
        skip = x if self.shortcut is None else self.shortcut(o)
        o = self.conv1(o)
        o = self.conv2(self.dropout(bn_relu(self.bn2, o)))
        return skip + o


class WideResNet(nn.Module):
    """WRN-depth-widen (arXiv:1605.07146), the backbone of most SSL papers (e.g. WRN-28-2)."""

    def __init__(self, depth: int, widen: int, num_classes: int, dropout: float = 0.0):
        super().__init__()
        if (depth - 4) % 6:
            raise ValueError(f"depth must be 6n+4, got {depth}")
        n = (depth - 4) // 6
        widths = [16 * widen, 32 * widen, 64 * widen]
        self.stem = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        blocks, cin = [], 16
        for g, cout in enumerate(widths):
            for i in range(n):
                blocks.append(PreActBlock(cin, cout, 2 if (g > 0 and i == 0) else 1, dropout))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.bn = nn.BatchNorm2d(cin)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.zeros_(self.fc.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = bn_relu(self.bn, self.blocks(self.stem(x)))
        return self.fc(x.mean((2, 3)))  # (N, C) global average pool


@register_model("wrn28_2")
def wrn28_2(num_classes: int) -> nn.Module:
    return WideResNet(28, 2, num_classes)


@register_model("wrn28_8")
def wrn28_8(num_classes: int) -> nn.Module:
    return WideResNet(28, 8, num_classes)
