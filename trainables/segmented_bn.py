"""Batch norm over a stack of batches, each normalised with its own statistics.

The reference calls the student once per batch (labeled, perturbed, mixed), so each batch is
normalised by its own batch statistics and each call updates the running statistics in turn.
Stacking the batches into one call gives every convolution a larger batch and halves the kernels
of a step; ``SegmentedBatchNorm2d`` keeps the result the same as separate calls: the same
outputs, gradients and running-statistics updates, in call order.

    with batch_segments(bns, ((256, True), (256, False))):   # (rows, updates running stats)
        logits = model(torch.cat([x_sup, x_mixed]))
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.segments is None or not self.training:
            return super().forward(x)
        outs = []
        for part, (_, update) in zip(x.split([n for n, _ in self.segments]), self.segments):
            self.num_batches_tracked.add_(1)   # as a separate call counts, frozen or not
            stats = (self.running_mean, self.running_var) if update else (None, None)
            outs.append(F.batch_norm(part, *stats, self.weight, self.bias, True, self.momentum, self.eps))
        return torch.cat(outs)


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


def segmentable(model: nn.Module) -> list[SegmentedBatchNorm2d] | None:
    """The model's batch-norm layers when every one can be segmented (none counts), else None."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._NormBase)]
    return bns if all(type(m) is SegmentedBatchNorm2d for m in bns) else None


@contextlib.contextmanager
def batch_segments(bns: Sequence[SegmentedBatchNorm2d], segments: Segments) -> Iterator[None]:
    for m in bns:
        m.segments = segments
    try:
        yield
    finally:
        for m in bns:
            m.segments = None
