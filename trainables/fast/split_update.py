"""A captured step's optimiser update and teacher EMA in two parts, around the join of the weight-gradient stream.

With ``train.fast.wgrad_stream`` the convolutions' weight gradients come from a side stream
(``trainables.fast.wgrad_stream``), which the main stream joins when the backward pass ends; every other gradient
(batch norm's scales and shifts, the classifier's) is complete on the main stream before that. So the update of those
parameters and the EMA of the teacher's other tensors (batch-norm statistics included) run before the join, beside
the side stream's last weight gradients, and only the convolution weights' update is left after it, at the end of
the step.

The kernels are PyTorch's SGD (through its functional form, as ``SGD.step`` calls it, with the optimiser's
own settings and momentum buffers) and our EMA, each applied to a part of the tensors, so the parameters
come out bit for bit as from one ``optimizer.step()`` and one EMA (``benchmarks/gpu_checks.py`` wgrad_stream,
tests/test_split_update.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.optim.sgd import sgd

from trainables.ssl.ema import EmaPairs


@dataclass
class UpdatePart:
    """The parameters of one part, per optimiser parameter group (by its index: loading a checkpoint's state
    replaces the group dicts, and the step graph then puts its device learning rate into the new ones), and the
    teacher/student tensors it averages."""
    groups: list[tuple[int, list[Tensor]]]
    pairs: EmaPairs


def split_update(optimizer: torch.optim.SGD, pairs: EmaPairs, student: nn.Module) -> tuple[UpdatePart, UpdatePart]:
    """(early, late): ``late`` holds the convolutions' parameters, ``early`` everything else."""
    late = {id(p) for m in student.modules() if isinstance(m, nn.Conv2d) for p in m.parameters(recurse=False)}
    parts = []
    for in_late in (False, True):
        groups = [(i, [p for p in g["params"] if (id(p) in late) == in_late])
                  for i, g in enumerate(optimizer.param_groups)]
        ema = pairs.select(lambda s, in_late=in_late: (id(s) in late) == in_late, counters=not in_late)
        parts.append(UpdatePart([(i, ps) for i, ps in groups if ps], ema))
    return parts[0], parts[1]


@torch.no_grad()
def sgd_part_(optimizer: torch.optim.SGD, part: UpdatePart) -> None:
    """``optimizer.step()`` for this part's parameters only, as ``SGD.step`` does it: the group's current settings,
    parameters without a gradient skipped, momentum buffers read from and written back to the optimiser's state
    (a missing one made by SGD's first step)."""
    for index, group_params in part.groups:
        group = optimizer.param_groups[index]
        params = [p for p in group_params if p.grad is not None]
        bufs = [optimizer.state[p].get("momentum_buffer") for p in params]
        sgd(params, [p.grad for p in params], bufs, has_sparse_grad=False, foreach=group["foreach"],
            fused=group["fused"], grad_scale=getattr(optimizer, "grad_scale", None),
            found_inf=getattr(optimizer, "found_inf", None), weight_decay=group["weight_decay"],
            momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"], nesterov=group["nesterov"],
            maximize=group["maximize"])
        if group["momentum"] != 0:
            for p, buf in zip(params, bufs):
                optimizer.state[p]["momentum_buffer"] = buf
