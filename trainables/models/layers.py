"""Layers the families share: TF "SAME" padding convolutions (reference §6) and the flax default initialisation."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def same_pad(x: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
    """Pad H and W by the TF/XLA "SAME" rule: odd totals put the extra row/col bottom/right.

    total = max((ceil(in/s) - 1)*s + k - in, 0), left = total // 2. For a stride-2 3x3 conv on an
    even size this is (0, 1), where PyTorch's ``padding=1`` would give (1, 1) and shift the grid.
    """
    h, w = x.shape[-2:]
    ph = max((math.ceil(h / stride) - 1) * stride + kernel - h, 0)
    pw = max((math.ceil(w / stride) - 1) * stride + kernel - w, 0)
    if ph == 0 and pw == 0:
        return x
    return F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))


class SameConv2d(nn.Conv2d):
    """Conv2d with TF "SAME" padding (reference §6), as in the flax models of arXiv:2003.12022."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, bias: bool = True):
        # Stride 1 with an odd kernel is symmetric, so plain padding avoids an extra F.pad copy.
        symmetric = stride == 1 and kernel % 2 == 1
        super().__init__(cin, cout, kernel, stride, padding=kernel // 2 if symmetric else 0, bias=bias)
        self.dynamic_pad = not symmetric

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with the SAME padding this convolution's own ``padding`` leaves out (stride 2: bottom and right)."""
        return same_pad(x, self.kernel_size[0], self.stride[0]) if self.dynamic_pad else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.pad(x))

    def with_weights(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """This convolution's padding and stride with other weights (a folded batch norm's), as a plain
        ``F.conv2d`` whatever class the layer was switched to."""
        return F.conv2d(self.pad(x), weight, bias, self.stride, self.padding, self.dilation, self.groups)


class BnFedConv2d(SameConv2d):
    """A ``SameConv2d`` without bias whose output goes straight into a batch norm, which would cancel one.

    A state dict that has the bias (the reference's layout, or a checkpoint of ours from before) loads through
    ``ShakeShakeBlock``, which folds the bias into that batch norm's running mean."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1):
        super().__init__(cin, cout, kernel, stride, bias=False)


def lecun_init_(model: nn.Module) -> None:
    """flax defaults: LeCun truncated-normal kernels (±2 std, std rescaled by 0.8796), zero biases."""
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            fan_in = m.weight[0].numel()
            std = math.sqrt(1.0 / fan_in) / 0.87962566103423978  # std of N(0,1) truncated at ±2
            nn.init.trunc_normal_(m.weight, std=std, a=-2 * std, b=2 * std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
