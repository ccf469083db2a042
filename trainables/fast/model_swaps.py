"""The models' fast variants, applied to a built model.

``speed_up_model(model)`` switches each block whose class ``FAST_BLOCKS`` names to that block's fast class, in place
(the class of the module changes; its parameters, buffers and state-dict keys do not), and sets the fast class's
switches on that block, all on unless asked otherwise; and it turns on the fast path's settings of every
``SegmentedBatchNorm2d`` (``BatchNormSwitches``), as attributes of each layer. The trainer does it to the student,
before the teacher is copied from it, only when ``train.fast`` is on (``trainables.fast.switch.prepare_student``); with
it off the models are the plain modules of ``trainables.models``. A fast class computes its plain block's function
(up to rounding) with fewer passes over the activations; the tests compare the two.

    speed_up_model(model)                          # the trainer's fast path: every switch on
    speed_up_model(model, fold_eval_bn=False)      # again, on a built model: an A/B timing or a check

Adding a fast variant: a subclass of the plain block that overrides ``forward``, a frozen dataclass of its switches,
and one entry in ``FAST_BLOCKS``. Today there is one, the shake-shake block's (``FastShakeShakeBlock``).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from trainables.fast.conv_bias_relu import conv_bias_relu
from trainables.fast.fast_conv import computes_on_rows
from trainables.fast.stored_grad import stored_grad
from trainables.models.layers import SameConv2d
from trainables.models.segmented_bn import SegmentedBatchNorm2d, pairs_in_one_pass
from trainables.models.shakeshake import ShakeShakeBlock


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShakeShakeSwitches:
    """The parts of ``FastShakeShakeBlock``'s forward, each on unless turned off (A/B timings in
    ``benchmarks/step_ab.py``, checks in ``benchmarks/gpu_checks.py``). Each block holds them as attributes of its own,
    read at each forward (once, when compiled or captured: so they are part of the first-compile key,
    ``model_switches``)."""
    one_first_conv: bool = True        # both branches' first convolutions (same input) as one of twice the width,
                                       # where our row kernels do not compute them (``branches``)
    fold_eval_bn: bool = True          # eval mode: each batch norm folded into the convolution before it (``folded``)
    store_input_grad: bool = True      # training under torch.compile: the gradient at the block's input stored by
                                       # Inductor (``stored_grad``) instead of recomputed in its readers
    paired_inner_bn_relu: bool = True  # with one_first_conv: both branches' inner batch norm and ReLU as one function
                                       # over the stacked output, whose backward is our own kernels
                                       # (trainables.fast.bn_relu_pair: ReLU's mask from the batch norm's input, no
                                       # read of its output)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchNormSwitches:
    """The fast path's settings of each ``SegmentedBatchNorm2d`` (off in the plain layer), each on unless turned off
    (``benchmarks/step_ab.py`` inline-stats); set on every such layer of a model by ``speed_up_model``, held as the
    layer's own attributes and read when it is traced (so part of the first-compile key, ``model_switches``)."""
    fuse_relu: bool = True             # ``forward_relu`` on the one-pass path and in ghost batches: the ReLU inside
                                       # the one-pass function, its backward's mask from the batch norm's input
    defer_stats: bool = True           # the one-pass calls' running statistics updated by ``batch_segments`` for every
                                       # layer at once after the stacked call, in a few foreach kernels


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


def bn_relu_pair_of(bn_a: nn.Module, bn_b: nn.Module, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two inner batch norms and ReLUs as one function (``trainables.fast.bn_relu_pair``), imported when first
    used: it needs Triton, which a CPU-only install may lack."""
    from trainables.fast.bn_relu_pair import bn_relu_pair_of as paired

    return paired(bn_a, bn_b, y)


class FastShakeShakeBlock(ShakeShakeBlock):
    """``ShakeShakeBlock`` computed with the parts ``ShakeShakeSwitches`` names, each as its block's attributes say
    (``speed_up_model`` sets them)."""

    one_first_conv: bool
    fold_eval_bn: bool
    store_input_grad: bool
    paired_inner_bn_relu: bool

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
        return self.shake(x, *self.branches(x))


# plain block class -> (its fast class, the dataclass of that class's switches)
FAST_BLOCKS: dict[type[nn.Module], tuple[type[nn.Module], type]] = {
    ShakeShakeBlock: (FastShakeShakeBlock, ShakeShakeSwitches),
}


def _entry(m: nn.Module) -> tuple[type[nn.Module], type] | None:
    """``m``'s entry in ``FAST_BLOCKS``: of its class, or of the plain class it was switched from."""
    return FAST_BLOCKS.get(type(m)) or next((e for e in FAST_BLOCKS.values() if type(m) is e[0]), None)


def speed_up_model(model: nn.Module, **switches: bool) -> nn.Module:
    """Switch every block of ``model`` that ``FAST_BLOCKS`` names (or that was switched before) to its fast class, and
    set ``BatchNormSwitches`` on every ``SegmentedBatchNorm2d``, with each switch ``switches`` names as given and the
    others on; returns ``model``.

    Raises:
        ValueError: a name in ``switches`` that no fast block's switches have.
    """
    kinds = (BatchNormSwitches, *(kind for _, kind in FAST_BLOCKS.values()))
    known = {f.name for kind in kinds for f in dataclasses.fields(kind)}
    unknown = sorted(set(switches) - known)
    if unknown:
        raise ValueError(f"Unknown switch {', '.join(map(repr, unknown))} of the fast blocks. Known: "
                         f"{', '.join(sorted(known))}")
    bn_names = {f.name for f in dataclasses.fields(BatchNormSwitches)}
    bn_switches = dataclasses.asdict(BatchNormSwitches(**{k: v for k, v in switches.items() if k in bn_names}))
    for m in model.modules():
        if isinstance(m, SegmentedBatchNorm2d):
            for name, value in bn_switches.items():
                setattr(m, name, value)
        entry = _entry(m)
        if entry is None:
            continue
        fast, kind = entry
        names = {f.name for f in dataclasses.fields(kind)}
        m.__class__ = fast
        for name, value in dataclasses.asdict(kind(**{k: v for k, v in switches.items() if k in names})).items():
            setattr(m, name, value)
    return model


def model_switches(model: nn.Module) -> list[tuple]:
    """The switches of ``model``'s fast blocks and batch norms, one (class name, (switch, value), ...) per distinct
    setting, sorted:
    what a compiled forward of ``model`` depends on besides its parameters (the first-compile key)."""
    seen = set()
    for m in model.modules():
        if isinstance(m, SegmentedBatchNorm2d):   # switched or not: a plain layer's are its class's (off)
            seen.add((type(m).__name__, *((f.name, getattr(m, f.name))
                                          for f in dataclasses.fields(BatchNormSwitches))))
        entry = _entry(m)
        if entry is not None and type(m) is entry[0]:
            seen.add((type(m).__name__, *((f.name, getattr(m, f.name)) for f in dataclasses.fields(entry[1]))))
    return sorted(seen)
