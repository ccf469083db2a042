"""Model registry: the Wide ResNets, shake-shake WRNs and ResNets used for CowMask experiments.

Paper: "Milking CowMask for Semi-Supervised Image Classification", French, Oliver, Salimans,
arXiv:2003.12022. The shake-shake WRN follows the published implementation
(`architectures/model_wrn_shakeshake.py`), see reference §6.1: 3x3 conv + BN shortcuts, LeCun
truncated-normal init and TF "SAME" padding on stride-2 convs. Its convolutions that feed a batch norm
carry no bias (``BnFedConv2d``): the reference gives them one, but batch norm takes each channel's mean
out, so the bias changes no output, its gradient is zero (up to rounding), and with the L2 penalty on
kernels only it stays at about its zero init; 26,942,474 parameters for 10 classes where the reference
counts 26,953,898. A state dict with those biases loads, each folded into its batch norm's running mean.

All models take NCHW float images (any size ≥ 32; `cnn_tiny` ≥ 8) and return logits (N, classes).
"""
from __future__ import annotations

import math
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from trainables.conv_bias_relu import conv_bias_relu
from trainables.fast_conv import computes_on_rows
from trainables.segmented_bn import bn_relu, bn_relu_pair_of, convert_batch_norm, pairs_in_one_pass
from trainables.stored_grad import stored_grad
from trainables.validation import unknown_name

MODELS: dict[str, Callable[[int], nn.Module]] = {}


def register_model(name: str) -> Callable[[Callable[[int], nn.Module]], Callable[[int], nn.Module]]:
    """Decorator adding ``builder(num_classes) -> nn.Module`` to MODELS under ``name``.

    Raises:
        ValueError: ``name`` is already registered (a silent overwrite would hide a clash).
    """
    if name in MODELS:
        raise ValueError(f"model '{name}' is already registered")

    def deco(builder: Callable[[int], nn.Module]) -> Callable[[int], nn.Module]:
        MODELS[name] = builder
        return builder

    return deco


def create_model(name: str, num_classes: int) -> nn.Module:
    """Build a registered model with freshly initialised weights (never downloads anything).

    Batch-norm layers are ``SegmentedBatchNorm2d``: plain batch norm unless a step stacks several
    batches into one call (``trainables.segmented_bn``).

    Raises:
        ConfigError: ``name`` is not registered; the message lists known names and the closest.
    """
    check_model(name)
    return convert_batch_norm(MODELS[name](num_classes))


def check_model(name: str) -> None:
    """Raises ConfigError, listing the known names and the closest, unless ``name`` is a registered model."""
    if name not in MODELS:
        raise unknown_name("model", name, MODELS)


def list_models() -> list[str]:
    return sorted(MODELS)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters (BN running statistics are buffers and not counted)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ----------------------------------------------------------------------------- building blocks

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


def shake_combine(a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor,
                  beta: torch.Tensor) -> torch.Tensor:
    """Shake-shake: value alpha*a + (1-alpha)*b, gradient as if beta*a + (1-beta)*b.

    Written with ``detach`` instead of a custom autograd.Function so torch.compile can trace it.
    Gates are broadcastable to ``a``, normally (N, 1, 1, 1).
    """
    return beta * a + (1 - beta) * b + ((alpha - beta) * (a - b)).detach()


# ----------------------------------------------------------------------------- Wide ResNet

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


# ----------------------------------------------------------------------------- shake-shake WRN

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
    # computed once under the model's 4 (docs/performance.md)
    return nn.Sequential(
        nn.ReLU(), _bn_fed_conv(cin, cout, stride), nn.BatchNorm2d(cout),
        nn.ReLU(), _bn_fed_conv(cout, cout, 1), nn.BatchNorm2d(cout))


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
                                 # the stacked output, whose backward is our own kernels (trainables.bn_relu_pair:
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


# ----------------------------------------------------------------------------- tiny CNN

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


# ----------------------------------------------------------------------------- registrations

@register_model("wrn28_2")
def wrn28_2(num_classes: int) -> nn.Module:
    return WideResNet(28, 2, num_classes)


@register_model("wrn28_8")
def wrn28_8(num_classes: int) -> nn.Module:
    return WideResNet(28, 8, num_classes)


@register_model("wrn26_6_shakeshake")
def wrn26_6_shakeshake(num_classes: int) -> nn.Module:
    return ShakeShakeWRN(4, 6, num_classes)


@register_model("wrn26_2_shakeshake")
def wrn26_2_shakeshake(num_classes: int) -> nn.Module:
    return ShakeShakeWRN(4, 2, num_classes)


@register_model("wrn20_6_shakeshake")
def wrn20_6_shakeshake(num_classes: int) -> nn.Module:
    return ShakeShakeWRN(3, 6, num_classes)


# torchvision definitions, random init; zero-init of the last BN matches reference §6.4.
def _torchvision_resnet(name: str, num_classes: int) -> nn.Module:
    import torchvision.models   # here, not at the top: torchvision imports torch._dynamo (2 s), which
    # a search driver or a `cowtune` command that builds no model never needs

    return getattr(torchvision.models, name)(weights=None, num_classes=num_classes, zero_init_residual=True)


@register_model("resnet18")
def resnet18(num_classes: int) -> nn.Module:
    return _torchvision_resnet("resnet18", num_classes)


@register_model("resnet50")
def resnet50(num_classes: int) -> nn.Module:
    return _torchvision_resnet("resnet50", num_classes)


@register_model("resnet152")
def resnet152(num_classes: int) -> nn.Module:
    return _torchvision_resnet("resnet152", num_classes)


@register_model("cnn_tiny")
def cnn_tiny(num_classes: int) -> nn.Module:
    return TinyCNN(num_classes)
