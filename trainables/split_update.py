"""A captured step's optimiser update and teacher EMA in two parts, around the join of the weight-gradient stream.

With ``train.wgrad_stream`` the convolutions' weight gradients come from a side stream (``trainables.wgrad_stream``),
which the main stream joins when the backward pass ends; every other gradient (batch norm's scales and shifts,
the classifier's) is complete on the main stream before that. So the update of those parameters and the EMA of
the teacher's other tensors (batch-norm statistics included) run before the join, beside the side stream's last
weight gradients, and only the convolution weights' update is left after it, at the end of the step.

The kernels are PyTorch's SGD (through its functional form, with the optimiser's own settings and momentum
buffers) and our EMA, each applied to a part of the tensors, so the parameters come out bit for bit as from
one ``optimizer.step()`` and one EMA (``benchmarks/gpu_checks.py`` wgrad_stream).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.optim.sgd import sgd

from trainables.ssl.ema import EmaPairs


@dataclass
class UpdatePart:
    """The parameters of one part, per optimiser parameter group, and the teacher/student tensors it averages."""
    groups: list[tuple[dict, list[Tensor]]]
    pairs: EmaPairs


def split_update(optimizer: torch.optim.SGD, pairs: EmaPairs, student: nn.Module) -> tuple[UpdatePart, UpdatePart]:
    """(early, late): ``late`` holds the convolutions' parameters, ``early`` everything else."""
    late = {id(p) for m in student.modules() if isinstance(m, nn.Conv2d) for p in m.parameters(recurse=False)}
    parts = []
    for in_late in (False, True):
        groups = [(g, [p for p in g["params"] if (id(p) in late) == in_late]) for g in optimizer.param_groups]
        keep = [i for i, s in enumerate(pairs.student_float) if (id(s) in late) == in_late]
        part = EmaPairs.__new__(EmaPairs)
        part.teacher_float = [pairs.teacher_float[i] for i in keep]
        part.student_float = [pairs.student_float[i] for i in keep]
        part.teacher_other = [] if in_late else pairs.teacher_other
        part.student_other = [] if in_late else pairs.student_other
        parts.append(UpdatePart([(g, ps) for g, ps in groups if ps], part))
    return parts[0], parts[1]


@torch.no_grad()
def sgd_part_(optimizer: torch.optim.SGD, part: UpdatePart) -> None:
    """``optimizer.step()`` for this part's parameters only. A missing momentum buffer starts at zero: SGD's first
    update, momentum * 0 + gradient, is then the gradient itself, as with the buffer SGD would make."""
    for group, params in part.groups:
        bufs = None
        if group["momentum"] != 0:
            for p in params:
                if optimizer.state[p].get("momentum_buffer") is None:
                    optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            bufs = [optimizer.state[p]["momentum_buffer"] for p in params]
        sgd(params, [p.grad for p in params], bufs if bufs is not None else [None] * len(params),
            has_sparse_grad=False, foreach=group["foreach"], fused=group["fused"],
            weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
            dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"])
