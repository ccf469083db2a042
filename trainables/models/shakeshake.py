"""The shake-shake WRNs of arXiv:2003.12022: ``wrn26_6_shakeshake`` (the paper's "WRN-26 shake-shake 96x2d"),
``wrn26_2_shakeshake``, ``wrn20_6_shakeshake``.

They follow the published implementation (`architectures/model_wrn_shakeshake.py`, reference §6.1): 3x3 conv + BN
shortcuts, LeCun truncated-normal init and TF "SAME" padding on stride-2 convs. Their convolutions that feed a batch
norm carry no bias (``BnFedConv2d``): the reference gives them one, but batch norm takes each channel's mean out, so
the bias changes no output, its gradient is zero (up to rounding), and with the L2 penalty on kernels only it stays
at about its zero init; 26,942,474 parameters for 10 classes where the reference counts 26,953,898. A state dict
with those biases loads, each folded into its batch norm's running mean.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from trainables.fast.conv_bias_relu import conv_bias_relu
from trainables.fast.fast_conv import computes_on_rows
from trainables.fast.stored_grad import stored_grad
from trainables.models.layers import BnFedConv2d, SameConv2d, lecun_init_
from trainables.models.registry import register_model
from trainables.models.segmented_bn import pairs_in_one_pass


def shake_combine(a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor,
                  beta: torch.Tensor) -> torch.Tensor:
    """Shake-shake: value alpha*a + (1-alpha)*b, gradient as if beta*a + (1-beta)*b.

    Written with ``detach`` instead of a custom autograd.Function so torch.compile can trace it.
    Gates are broadcastable to ``a``, normally (N, 1, 1, 1).
    """
    return beta * a + (1 - beta) * b + ((alpha - beta) * (a - b)).detach()


def _bn_fed_conv(cin: int, cout: int, stride: int) -> SameConv2d:
    """A 3x3 convolution feeding a batch norm: without bias, or with one where ``ShakeShakeBlock.bias_free_bn_convs``
    is off (the reference's layout, for A/B timings)."""
    if ShakeShakeBlock.bias_free_bn_convs:
        return BnFedConv2d(cin, cout, 3, stride)
    return SameConv2d(cin, cout, 3, stride)


def _foldable(bn: nn.Module) -> bool:
    """A batch norm in eval mode that normalises by running statistics, with an affine transform (one left in
    training mode inside an eval-mode block, as batch-norm recalibration does, uses batch statistics)."""
    return isinstance(bn, nn.BatchNorm2d) and not bn.training and bn.affine and bn.running_mean is not None


def _fold(conv: SameConv2d, bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, bias) of one convolution computing ``bn(conv(x))`` in eval mode."""
    scale = bn.weight * torch.rsqrt(bn.running_var + bn.eps)
    shift = bn.bias - bn.running_mean * scale
    if conv.bias is not None:
        shift = shift + conv.bias * scale
    return conv.weight * scale.view(-1, 1, 1, 1), shift


def _branch(cin: int, cout: int, stride: int) -> nn.Sequential:
    # The inner BN + ReLU stays two modules: as one bn_relu it ran slower (H100: 1% on 2026-11-26; 1.6% on 2026-11-28
    # under realize_reads_threshold 8, where Inductor recomputes its masked gradient). On an H200 (2026-11-28) it moved
    # 2.8 GB a step less under 8 but was within noise (+0.7%), and 2.4% slower with its per-channel coefficients
    # computed once under the model's 4 (docs/journal/2026-11-28.md)
    return nn.Sequential(
        nn.ReLU(), _bn_fed_conv(cin, cout, stride), nn.BatchNorm2d(cout),
        nn.ReLU(), _bn_fed_conv(cout, cout, 1), nn.BatchNorm2d(cout))


def bn_relu_pair_of(bn_a: nn.Module, bn_b: nn.Module, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two inner batch norms and ReLUs as one function (``trainables.fast.bn_relu_pair``), imported when first
    used: it needs Triton, which a CPU-only install may lack."""
    from trainables.fast.bn_relu_pair import bn_relu_pair_of as paired

    return paired(bn_a, bn_b, y)


class ShakeShakeBlock(nn.Module):
    """Two-branch shake-shake block (Gastaldi, arXiv:1705.07485) as in arXiv:2003.12022 §6.1."""

    # switches for A/B timings (benchmarks/step_ab.py), on by default:
    one_first_conv = True       # both branches' first convolutions (same input) as one of twice the width, where
                                # our row kernels do not compute them (``branches``); read at each forward (once,
                                # when compiled or captured)
    bias_free_bn_convs = True   # convolutions feeding a batch norm built without bias; read when built
    fold_eval_bn = True         # eval mode: each batch norm folded into the convolution before it (``folded``);
                                # read at each forward (once, when compiled or captured)
    store_input_grad = True     # training under torch.compile: the gradient at the block's input stored by Inductor
                                # (``stored_grad``) instead of recomputed in its readers; read when traced
    paired_inner_bn_relu = True  # with one_first_conv: both branches' inner batch norm and ReLU as one function over
                                 # the stacked output, whose backward is our own kernels (trainables.fast.bn_relu_pair:
                                 # ReLU's mask from the batch norm's input, no read of its output); read when traced
    COMPILE_KEY_SWITCHES = ("one_first_conv", "bias_free_bn_convs", "fold_eval_bn", "store_input_grad",
                            "paired_inner_bn_relu")

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.branch_a, self.branch_b = _branch(cin, cout, stride), _branch(cin, cout, stride)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            # One 3x3 conv + BN on the raw input, not the paper-original pooled 1x1 pair.
            self.shortcut = nn.Sequential(_bn_fed_conv(cin, cout, stride), nn.BatchNorm2d(cout))

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

    def branches(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Both branches on ``x``. Their first convolutions read the same ReLU(x), so with ``one_first_conv`` they
        run as one convolution with the two weights stacked: the same sums, one pass over the input, and one
        input gradient that adds both branches' contributions as it goes. Not where our row kernels compute them
        (``computes_on_rows``): their cost is the output's traffic, the same either way, and one by one each
        weight gradient runs on the side stream from its own layer."""
        conv_a, conv_b = self.branch_a[1], self.branch_b[1]   # _branch: ReLU, conv, BN, ReLU, conv, BN
        if not self.one_first_conv or computes_on_rows(conv_a, x):
            return self.branch_a(x), self.branch_b(x)
        bias = None if conv_a.bias is None else torch.cat([conv_a.bias, conv_b.bias])
        y = conv_a.with_weights(F.relu(x), torch.cat([conv_a.weight, conv_b.weight]), bias)
        bn_a, bn_b = self.branch_a[2], self.branch_b[2]
        if self.paired_inner_bn_relu and pairs_in_one_pass(bn_a, bn_b, y):
            ha, hb = bn_relu_pair_of(bn_a, bn_b, y)
            return self.branch_a[4:](ha), self.branch_b[4:](hb)
        ya, yb = y.split(conv_a.out_channels, dim=1)
        return self.branch_a[2:](ya), self.branch_b[2:](yb)

    def _all_foldable(self) -> bool:
        return all(_foldable(m) for m in self.modules() if isinstance(m, nn.modules.batchnorm._NormBase))

    def folded(self, x: torch.Tensor) -> torch.Tensor:
        """The eval-mode forward with each batch norm folded into the convolution before it: the same function up
        to rounding, with fewer passes over the activations. The first convolutions always run stacked here,
        their batch norms as a bias and ReLU in the convolution's own epilogue (``conv_bias_relu``, where no gradient
        is wanted); the second ones run as one convolution over both branches' channels, whose weights, halved,
        also take the average 0.5 * (a + b)."""
        conv_a, bn_a, _, conv_a2, bn_a2 = self.branch_a[1:]
        conv_b, bn_b, _, conv_b2, bn_b2 = self.branch_b[1:]
        (wa, ba), (wb, bb) = _fold(conv_a, bn_a), _fold(conv_b, bn_b)
        h = conv_bias_relu(conv_a.pad(F.relu(x)), torch.cat([wa, wb]), torch.cat([ba, bb]), conv_a.stride,
                           conv_a.padding)
        (wa, ba), (wb, bb) = _fold(conv_a2, bn_a2), _fold(conv_b2, bn_b2)
        mixed = conv_a2.with_weights(h, 0.5 * torch.cat([wa, wb], dim=1), 0.5 * (ba + bb))
        if isinstance(self.shortcut, nn.Identity):
            return x + mixed
        conv, bn = self.shortcut
        w, bias = _fold(conv, bn)
        return conv.with_weights(x, w, bias) + mixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and self.fold_eval_bn and self._all_foldable():
            return self.folded(x)
        if self.store_input_grad:
            x = stored_grad(x)
        a, b = self.branches(x)
        if self.training:
            # Global RNG on purpose: the trainer reseeds it; fresh per-sample gates every call.
            shape = (x.shape[0], 1, 1, 1)
            alpha = torch.rand(shape, device=x.device, dtype=a.dtype)
            beta = torch.rand(shape, device=x.device, dtype=a.dtype)
            mixed = shake_combine(a, b, alpha, beta)
        else:
            mixed = 0.5 * (a + b)
        return self.shortcut(x) + mixed  # no ReLU after the addition


class ShakeShakeWRN(nn.Module):
    """WRN shake-shake with 3x3 conv shortcuts ("WRN-26 shake-shake 96x2d"), arXiv:2003.12022."""

    def __init__(self, blocks_per_group: int, widen: int, num_classes: int):
        super().__init__()
        self.stem = SameConv2d(3, 16, 3, 1)  # bias, and no BN/ReLU after it
        blocks, cin = [], 16
        for g, cout in enumerate([16 * widen, 32 * widen, 64 * widen]):
            for i in range(blocks_per_group):
                blocks.append(ShakeShakeBlock(cin, cout, 2 if (g > 0 and i == 0) else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)
        lecun_init_(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.blocks(self.stem(x)))
        return self.fc(x.mean((2, 3)))  # (N, C); the 8x8 pool of the reference at 32x32


@register_model("wrn26_6_shakeshake")
def wrn26_6_shakeshake(num_classes: int) -> nn.Module:
    return ShakeShakeWRN(4, 6, num_classes)


@register_model("wrn26_2_shakeshake")
def wrn26_2_shakeshake(num_classes: int) -> nn.Module:
    return ShakeShakeWRN(4, 2, num_classes)


@register_model("wrn20_6_shakeshake")
def wrn20_6_shakeshake(num_classes: int) -> nn.Module:
    return ShakeShakeWRN(3, 6, num_classes)

