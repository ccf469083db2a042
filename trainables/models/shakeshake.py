"""The shake-shake WRNs of arXiv:2003.12022: ``wrn26_6_shakeshake`` (the paper's "WRN-26 shake-shake 96x2d"),
``wrn26_2_shakeshake``, ``wrn20_6_shakeshake``.

They follow the published implementation (`architectures/model_wrn_shakeshake.py`, reference §6.1): 3x3 conv + BN
shortcuts, LeCun truncated-normal init and TF "SAME" padding on stride-2 convs. Their convolutions that feed a batch
norm carry no bias (``BnFedConv2d``): the reference gives them one, but batch norm takes each channel's mean out, so
the bias changes no output, its gradient is zero (up to rounding), and with the L2 penalty on kernels only it stays
at about its zero init; 26,942,474 parameters for 10 classes where the reference counts 26,953,898. A state dict
with those biases loads, each folded into its batch norm's running mean; ``bn_conv_bias=True`` builds the
reference's layout.

These are the plain modules, the specification. The fast path (``trainables.fast.model_swaps``) switches a built
model's blocks to a variant that computes the same function with fewer passes over memory.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from trainables.models.layers import BnFedConv2d, SameConv2d, lecun_init_
from trainables.models.registry import register_model


def shake_combine(a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor,
                  beta: torch.Tensor) -> torch.Tensor:
    """Shake-shake: value alpha*a + (1-alpha)*b, gradient as if beta*a + (1-beta)*b.

    Written with ``detach`` instead of a custom autograd.Function so torch.compile can trace it.
    Gates are broadcastable to ``a``, normally (N, 1, 1, 1).
    """
    return beta * a + (1 - beta) * b + ((alpha - beta) * (a - b)).detach()


def _bn_fed_conv(cin: int, cout: int, stride: int, bias: bool) -> SameConv2d:
    """A 3x3 convolution feeding a batch norm: without bias, or with one in the reference's layout."""
    return SameConv2d(cin, cout, 3, stride) if bias else BnFedConv2d(cin, cout, 3, stride)


def _branch(cin: int, cout: int, stride: int, bias: bool) -> nn.Sequential:
    # The inner BN + ReLU stays two modules: as one function it measured slower (docs/journal/2026-11-28.md)
    return nn.Sequential(
        nn.ReLU(), _bn_fed_conv(cin, cout, stride, bias), nn.BatchNorm2d(cout),
        nn.ReLU(), _bn_fed_conv(cout, cout, 1, bias), nn.BatchNorm2d(cout))


class ShakeShakeBlock(nn.Module):
    """Two-branch shake-shake block (Gastaldi, arXiv:1705.07485) as in arXiv:2003.12022 §6.1.

    ``bn_conv_bias``: the reference's layout, a bias on each convolution that feeds a batch norm."""

    def __init__(self, cin: int, cout: int, stride: int, bn_conv_bias: bool = False):
        super().__init__()
        self.branch_a = _branch(cin, cout, stride, bn_conv_bias)
        self.branch_b = _branch(cin, cout, stride, bn_conv_bias)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            # One 3x3 conv + BN on the raw input, not the paper-original pooled 1x1 pair.
            self.shortcut = nn.Sequential(_bn_fed_conv(cin, cout, stride, bn_conv_bias), nn.BatchNorm2d(cout))

    def bn_fed_convs(self) -> Iterator[tuple[str, str]]:
        """(convolution, batch norm) names, relative to the block, of each ``BnFedConv2d`` and the batch norm
        it feeds."""
        for name, seq in self.named_children():
            if isinstance(seq, nn.Sequential):
                for i, (conv, bn) in enumerate(zip(seq, seq[1:])):
                    if isinstance(conv, BnFedConv2d) and isinstance(bn, nn.BatchNorm2d):
                        yield f"{name}.{i}", f"{name}.{i + 1}"

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args) -> None:
        """A state dict whose convolutions feeding a batch norm have a bias loads with the bias folded into that
        batch norm's running mean (``running_mean - bias``): the same outputs in eval mode, and in training,
        where batch norm subtracts the batch mean, none to change. (In a trained reference-layout model the
        bias is not exactly zero: its gradient is zero up to rounding, which momentum adds up.)"""
        for conv, bn in self.bn_fed_convs():
            bias = state_dict.pop(f"{prefix}{conv}.bias", None)
            mean = f"{prefix}{bn}.running_mean"
            if bias is not None and mean in state_dict:
                state_dict[mean] = state_dict[mean] - bias.to(state_dict[mean].dtype)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def shake(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The block's output from its input ``x`` and its branches' outputs ``a``, ``b``: in training, each
        sample's random gates; in eval mode, their expectation, the average."""
        if self.training:
            # Global RNG on purpose: the trainer reseeds it; fresh per-sample gates every call.
            shape = (x.shape[0], 1, 1, 1)
            alpha = torch.rand(shape, device=x.device, dtype=a.dtype)
            beta = torch.rand(shape, device=x.device, dtype=a.dtype)
            mixed = shake_combine(a, b, alpha, beta)
        else:
            mixed = 0.5 * (a + b)
        return self.shortcut(x) + mixed  # no ReLU after the addition

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shake(x, self.branch_a(x), self.branch_b(x))


class ShakeShakeWRN(nn.Module):
    """WRN shake-shake with 3x3 conv shortcuts ("WRN-26 shake-shake 96x2d"), arXiv:2003.12022."""

    def __init__(self, blocks_per_group: int, widen: int, num_classes: int, bn_conv_bias: bool = False):
        super().__init__()
        self.stem = SameConv2d(3, 16, 3, 1)  # bias, and no BN/ReLU after it
        blocks, cin = [], 16
        for g, cout in enumerate([16 * widen, 32 * widen, 64 * widen]):
            for i in range(blocks_per_group):
                blocks.append(ShakeShakeBlock(cin, cout, 2 if (g > 0 and i == 0) else 1, bn_conv_bias))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)
        lecun_init_(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.blocks(self.stem(x)))
        return self.fc(x.mean((2, 3)))  # (N, C); the 8x8 pool of the reference at 32x32


@register_model("wrn26_6_shakeshake")
def wrn26_6_shakeshake(num_classes: int, bn_conv_bias: bool = False) -> nn.Module:
    return ShakeShakeWRN(4, 6, num_classes, bn_conv_bias)


@register_model("wrn26_2_shakeshake")
def wrn26_2_shakeshake(num_classes: int, bn_conv_bias: bool = False) -> nn.Module:
    return ShakeShakeWRN(4, 2, num_classes, bn_conv_bias)


@register_model("wrn20_6_shakeshake")
def wrn20_6_shakeshake(num_classes: int, bn_conv_bias: bool = False) -> nn.Module:
    return ShakeShakeWRN(3, 6, num_classes, bn_conv_bias)
