"""Batch norm over a stack of batches, each normalised with its own statistics.

The reference calls the student once per batch (labeled, perturbed, mixed), so each batch is
normalised by its own batch statistics and each call updates the running statistics in turn.
Stacking the batches into one call gives every convolution a larger batch and halves the kernels
of a step; ``SegmentedBatchNorm2d`` keeps the result the same as separate calls: the same
outputs, gradients and running-statistics updates, in call order.

    with batch_segments(bns, ((256, True), (256, False))):   # (rows, updates running stats)
        logits = model(torch.cat([x_sup, x_mixed]))

Under ``torch.compile``, segments of equal size (the trainer's case: the labeled and unlabeled
batches have one size) are normalised in one pass over a view of the stack, with batch norm's
analytic backward (``_EqualSegmentsBatchNorm``), which Inductor fuses into as few kernels as one
batch norm; otherwise (and eagerly, where the native kernels are faster) each segment is a separate
``F.batch_norm`` call and the results are concatenated. The one-pass calls leave their running-statistics
updates to ``batch_segments``, which makes them for every layer at once when the call returns
(``defer_stats``, on where the fast path sets it): a few foreach kernels instead of two or three small ones per
layer.

Ghost batch norm (``set_ghost_batch``, the config's ``train.bn_batch``): in training mode each batch is
normalised in groups of ``ghost`` rows, each group with its own statistics, as the reference's per-device
statistics were under ``pmap`` (8 devices: 32 of a 256 batch). A call's running statistics then move toward the
mean over its groups of their means and variances, once per call, as an average over devices would. Stacked
or not, compiled or eager, the groups run through the one-pass function (layer by layer: not paired with
``bn_relu_pair``).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

Segments = tuple[tuple[int, bool], ...]


class SegmentedBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` that, while ``segments`` is set and in train mode, normalises each run of
    rows with that run's statistics; a segment marked ``False`` leaves the running statistics as
    they are (the momentum-0 calls of the reference)."""

    segments: Segments | None = None
    ghost: int | None = None  # training: rows per ghost batch (``set_ghost_batch``); None: the whole batch
    one_pass_eager = False   # the one-pass path also when not compiling (tests; changes no compiled graph)
    # Two settings of each layer that the fast path turns on (trainables.fast.model_swaps.speed_up_model: the layer's
    # own attributes, BatchNormSwitches); here, in the plain layer, off. Neither changes a result (the tests compare).
    fuse_relu = False        # forward_relu on the one-pass path: the ReLU inside the one-pass function (off: after it)
    # the one-pass path leaves its statistics to ``batch_segments``, which updates every layer's running statistics
    # and batch count in a few foreach kernels after the call, instead of two to three small kernels per layer inside
    # it (fewer launches; measured in docs/journal/2026-11-28.md); off: inside
    defer_stats = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ghost is not None and self.training:
            return self._ghost_batches(x)
        if self.segments is None or not self.training:
            return super().forward(x)
        return self._equal_segments(x) if self._one_pass(x) else self._split_segments(x)

    def forward_relu(self, x: torch.Tensor) -> torch.Tensor:
        """``relu(self(x))``, with the ReLU inside the one-pass function when that path runs."""
        if self.ghost is not None and self.training:
            y = self._ghost_batches(x, relu=self.fuse_relu)
            return y if self.fuse_relu else F.relu(y)
        if self.fuse_relu and self.segments is not None and self.training and self._one_pass(x):
            return self._equal_segments(x, relu=True)
        return F.relu(self(x))

    def call_segments(self, x: torch.Tensor) -> Segments:
        """The segments of this call: those of a stacked call, else the whole batch as one that updates."""
        return self.segments if self.segments is not None else ((x.shape[0], True),)

    def ghost_groups(self, x: torch.Tensor) -> int:
        """How many ghost batches ``x`` holds; raises ValueError unless each segment is a whole number of them."""
        segments = self.call_segments(x)
        if x.dim() != 4 or any(n % self.ghost for n, _ in segments) or sum(n for n, _ in segments) != x.shape[0]:
            raise ValueError(f"ghost batch norm of {self.ghost} rows needs batches of a multiple of {self.ghost}, "
                             f"got segments {[n for n, _ in segments]} of an input of shape {tuple(x.shape)}")
        return x.shape[0] // self.ghost

    def ghost_stats(self, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> None:
        """Track the per-group ``mean`` and biased ``var`` (groups, C) of a ghost call: averaged over each segment's
        groups, once per segment (deferred inside ``batch_segments``; at once otherwise)."""
        segments = self.call_segments(x)
        counts = [n // self.ghost for n, _ in segments]
        mean = torch.stack([m.mean(0) for m in mean.split(counts)])
        var = torch.stack([v.mean(0) for v in var.split(counts)])
        self._track(mean, var, self.ghost * x.shape[2] * x.shape[3], segments, defer=self.segments is not None)

    def _ghost_batches(self, x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        groups = self.ghost_groups(x)
        y, mean, var = _EqualSegmentsBatchNorm.apply(x, self.weight, self.bias, groups, self.eps, relu)
        self.ghost_stats(x, mean, var)
        return y

    def _one_pass(self, x: torch.Tensor) -> bool:
        """Compiling, and equal segments that cover ``x`` with 2+ values per channel each, on a layer
        with an affine transform and running statistics (else the split path, whose F.batch_norm
        raises on bad input)."""
        if not (self.one_pass_eager or torch.compiler.is_compiling()):
            return False
        sizes = {n for n, _ in self.segments}
        rows = next(iter(sizes))
        return (len(sizes) == 1 and x.dim() == 4 and x.shape[0] == rows * len(self.segments)
                and rows * x.shape[2] * x.shape[3] > 1 and self.affine and self.track_running_stats
                and self.momentum is not None)

    def _split_segments(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for part, (_, update) in zip(x.split([n for n, _ in self.segments]), self.segments):
            self.num_batches_tracked.add_(1)   # as a separate call counts, frozen or not
            stats = (self.running_mean, self.running_var) if update else (None, None)
            outs.append(F.batch_norm(part, *stats, self.weight, self.bias, True, self.momentum, self.eps))
        return torch.cat(outs)

    def _equal_segments(self, x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        s = len(self.segments)
        y, mean, var = _EqualSegmentsBatchNorm.apply(x, self.weight, self.bias, s, self.eps, relu)
        self._track(mean, var, x.numel() // (s * self.num_features))
        return y

    def _track(self, mean: torch.Tensor, var: torch.Tensor, n: int, segments: Segments | None = None,
               defer: bool = True) -> None:
        """The running statistics and batch counts of a one-pass call: ``mean`` and biased ``var`` (segments, C) over
        ``n`` values per segment and channel; deferred to ``batch_segments`` with ``defer_stats`` (and ``defer``)."""
        if self.defer_stats and defer:
            _DEFERRED.append((self, mean.detach(), var.detach(), n / (n - 1)))   # detached: outputs of no gradient
            return
        with torch.no_grad():
            var = var * (n / (n - 1))   # running variance is unbiased, as in F.batch_norm
            for i, (_, update) in enumerate(segments or self.segments):
                self.num_batches_tracked.add_(1)
                if update:
                    self.running_mean.lerp_(mean[i].to(self.running_mean.dtype), self.momentum)
                    self.running_var.lerp_(var[i].to(self.running_var.dtype), self.momentum)


def segment_affine(mean: torch.Tensor, var: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rstd, scale, shift) of a batch norm over equal segments, in the statistics' dtype: per-segment ``mean`` and
    biased ``var`` (s, 1, C, 1, 1) with the layer's ``weight`` and ``bias`` (C,); its output is x * scale + shift."""
    rstd = torch.rsqrt(var + eps)
    scale = rstd * weight.to(var.dtype).view(1, 1, -1, 1, 1)
    return rstd, scale, bias.to(var.dtype).view(1, 1, -1, 1, 1) - mean * scale


def segment_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, s: int, eps: float,
                    relu: bool) -> tuple[torch.Tensor, ...]:
    """Training-mode batch norm of ``s`` equal runs of ``x``'s rows, each with its own statistics (float32 at least),
    followed by a ReLU if ``relu``: (output in x's dtype, a copy of x's shape; mean, biased var, rstd, scale and shift,
    each (s, 1, C, 1, 1)). Under Inductor, one kernel for the statistics and one that writes the output once, in the
    layout its reader asks for."""
    xs = x.unflatten(0, (s, -1)).to(torch.promote_types(x.dtype, torch.float32))
    var, mean = torch.var_mean(xs, dim=(1, 3, 4), keepdim=True, correction=0)
    rstd, scale, shift = segment_affine(mean, var, weight, bias, eps)
    z = xs * scale + shift
    # a copy, not a view of the 5-d result: a following in-place op (ReLU(inplace=True)) must not
    # rewrite a custom Function's output view; Inductor fuses the copy into the normalisation
    return (z.relu() if relu else z).to(x.dtype).flatten(0, 1).clone(), mean, var, rstd, scale, shift


def segment_backward(dys: torch.Tensor, xs: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                     scale: torch.Tensor, shift: torch.Tensor,
                     relu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward pass of ``segment_affine``'s batch norm, followed by a ReLU if ``relu`` (its mask from the input
    ``xs``, not from a read of its output), for the output gradient ``dys``; both (s, rows, C, H, W) in the
    statistics' dtype. Returns (dx in that shape and dtype, the weight's gradient (C,), the bias's (C,))."""
    if relu:
        dys = torch.where(xs * scale + shift > 0, dys, 0.0)
    n = xs.numel() // (xs.shape[0] * xs.shape[2])
    xhat = (xs - mean) * rstd
    sum_dy = dys.sum(dim=(1, 3, 4), keepdim=True)
    sum_dy_xhat = (dys * xhat).sum(dim=(1, 3, 4), keepdim=True)
    dx = scale * (dys - sum_dy / n - xhat * (sum_dy_xhat / n))
    return dx, sum_dy_xhat.sum((0, 1, 3, 4)), sum_dy.sum((0, 1, 3, 4))


class _EqualSegmentsBatchNorm(torch.autograd.Function):
    """Training-mode batch norm of ``s`` equal runs of rows, each with its own statistics, in one pass
    over ``x`` viewed as (s, rows, C, H, W) (a view in either memory format), followed by a ReLU if
    ``relu``. Statistics are computed in float32 at least; returns (y in x's dtype, per-run means
    (s, C), biased variances (s, C)).

    The output is ``x * scale + shift`` with per-run, per-channel ``scale`` and ``shift`` saved for the
    backward, which re-derives ReLU's mask from ``x`` by the same expression: four reads, few enough
    that Inductor recomputes the masked gradient inside both backward kernels instead of storing it."""

    @staticmethod
    def forward(ctx, x, weight, bias, s, eps, relu):
        y, mean, var, rstd, scale, shift = segment_forward(x, weight, bias, s, eps, relu)
        ctx.save_for_backward(x, mean, rstd, scale, shift)
        ctx.s, ctx.relu, ctx.weight_dtype = s, relu, weight.dtype
        stats = mean.view(s, -1), var.view(s, -1)
        ctx.mark_non_differentiable(*stats)
        return y, *stats

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar):
        x, mean, rstd, scale, shift = ctx.saved_tensors
        xs = x.unflatten(0, (ctx.s, -1)).to(mean.dtype)
        dys = dy.unflatten(0, (ctx.s, -1)).to(mean.dtype)
        dx, dweight, dbias = segment_backward(dys, xs, mean, rstd, scale, shift, ctx.relu)
        return (dx.to(x.dtype).flatten(0, 1), dweight.to(ctx.weight_dtype), dbias.to(ctx.weight_dtype), None, None,
                None)


def bn_relu(bn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``relu(bn(x))``: one function with a leaner backward on the one-pass path of a
    ``SegmentedBatchNorm2d``; any other batch norm is called as it is."""
    return bn.forward_relu(x) if isinstance(bn, SegmentedBatchNorm2d) else F.relu(bn(x))


def pairs_in_one_pass(bn_a: nn.Module, bn_b: nn.Module, y: torch.Tensor) -> bool:
    """Whether ``fast.bn_relu_pair.bn_relu_pair_of`` runs one function for these two batch norms on ``y``: both on
    the one-pass path (``SegmentedBatchNorm2d``, compiling, equal segments), of one width, epsilon and weight dtype,
    and ``y`` holding both their channels."""
    return (isinstance(bn_a, SegmentedBatchNorm2d) and isinstance(bn_b, SegmentedBatchNorm2d) and bn_a.training
            and bn_b.training and bn_a.ghost is None and bn_b.ghost is None   # ghost batches: each layer on its own
            and bn_a.segments is not None and bn_a.segments == bn_b.segments
            and bn_a.eps == bn_b.eps and bn_a.num_features == bn_b.num_features
            and bn_a.weight.dtype == bn_b.weight.dtype and y.dim() == 4 and y.shape[1] == 2 * bn_a.num_features
            and bn_a._one_pass(y) and bn_b._one_pass(y))


def convert_batch_norm(model: nn.Module) -> nn.Module:
    """Replace every plain ``nn.BatchNorm2d`` with a fixed momentum by a ``SegmentedBatchNorm2d``
    holding the same parameters and buffers; returns ``model``."""
    for name, child in model.named_children():
        if type(child) is nn.BatchNorm2d and child.momentum is not None and child.track_running_stats:
            new = SegmentedBatchNorm2d(child.num_features, child.eps, child.momentum, child.affine,
                                       device=child.running_mean.device, dtype=child.running_mean.dtype)
            new.load_state_dict(child.state_dict())
            new.train(child.training)
            setattr(model, name, new)
        else:
            convert_batch_norm(child)
    return model


def set_ghost_batch(model: nn.Module, rows: int | None) -> None:
    """Make every ``SegmentedBatchNorm2d`` of ``model`` normalise training batches in groups of ``rows`` (ghost batch
    norm); None: each batch whole, as plain batch norm."""
    if rows is not None and rows < 2:
        raise ValueError(f"a ghost batch needs at least 2 rows, got {rows}")
    for m in model.modules():
        if isinstance(m, SegmentedBatchNorm2d):
            m.ghost = rows


def segmentable(model: nn.Module) -> list[SegmentedBatchNorm2d] | None:
    """The model's batch-norm layers when every one can be segmented (none counts), else None."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._NormBase)]
    return bns if all(type(m) is SegmentedBatchNorm2d for m in bns) else None


# (layer, per-segment means, biased variances, unbiasing factor) of the one-pass calls inside ``batch_segments``
# with ``defer_stats`` on, in call order; under torch.compile, Dynamo replays the appends after the compiled call
_DEFERRED: list[tuple[SegmentedBatchNorm2d, torch.Tensor, torch.Tensor, float]] = []


@contextlib.contextmanager
def batch_segments(bns: Sequence[SegmentedBatchNorm2d], segments: Segments) -> Iterator[None]:
    if any(m.segments is not None for m in bns):
        raise RuntimeError("batch_segments cannot be nested: these batch norms are inside a stacked call already")
    _DEFERRED.clear()
    for m in bns:
        m.segments = segments
    try:
        yield
        _update_deferred(segments)
    finally:
        _DEFERRED.clear()
        for m in bns:
            m.segments = None


@torch.no_grad()
def _update_deferred(segments: Segments) -> None:
    """The running statistics and batch counts the deferred one-pass calls left, as the layers would have updated
    them call by call: a layer called twice (a shared module) updates in a second round, after the first."""
    rounds: list[list[tuple]] = []
    calls: dict[int, int] = {}
    for entry in _DEFERRED:
        k = calls[id(entry[0])] = calls.get(id(entry[0]), -1) + 1
        if k == len(rounds):
            rounds.append([])
        rounds[k].append(entry)
    for entries in rounds:
        _update_layers(entries, segments)


def _update_layers(entries: list[tuple], segments: Segments) -> None:
    """For each segment that updates, in order, every layer's running mean and (unbiased) variance moved toward
    that segment's statistics by the layer's momentum, and each batch count up by the number of segments: a few
    foreach kernels for all the layers (each at most once in ``entries``)."""
    layers = [m for m, *_ in entries]
    torch._foreach_add_([m.num_batches_tracked for m in layers], len(segments))
    unbiased = torch._foreach_mul([v for _, _, v, _ in entries], [f for *_, f in entries])
    running = [m.running_mean for m in layers] + [m.running_var for m in layers]
    by_momentum: dict[float, list[int]] = {}
    for j, m in enumerate(layers):
        by_momentum.setdefault(m.momentum, []).append(j)
    for i, (_, update) in enumerate(segments):
        if not update:
            continue
        stats = [mean[i].to(m.running_mean.dtype) for m, mean, _, _ in entries] + \
                [v[i].to(m.running_var.dtype) for m, v in zip(layers, unbiased)]
        for momentum, js in by_momentum.items():
            picks = js + [len(layers) + j for j in js]
            torch._foreach_lerp_([running[p] for p in picks], [stats[p] for p in picks], momentum)
