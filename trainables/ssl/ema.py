"""Mean Teacher: the teacher is an exponential moving average of the student.

"Mean teachers are better role models", Tarvainen and Valpola, arXiv:1703.01780, as used by
"Milking CowMask", arXiv:2003.12022: after every optimiser step
teacher <- alpha * teacher + (1 - alpha) * student, over the parameters AND the floating-point
buffers (batch-norm running mean and variance); integer buffers (num_batches_tracked) are
copied. The teacher is a separate module, kept in eval mode, never swapped into the student.
"""
from __future__ import annotations

import contextlib
import copy
import struct
from typing import Callable

import torch
from torch import nn


def make_teacher(student: nn.Module) -> nn.Module:
    """An exact copy of the student, in eval mode, without gradients."""
    teacher = copy.deepcopy(student)
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher


def teacher_logits(teacher: Callable[[torch.Tensor], torch.Tensor], autocast: contextlib.AbstractContextManager,
                   memory_format: torch.memory_format, x: torch.Tensor) -> torch.Tensor:
    """stop_gradient(g_phi(x)): the teacher's logits on ``x`` (in ``memory_format``, under ``autocast``), without
    gradient and in float32 or wider. The teacher is always in eval mode."""
    with torch.no_grad(), autocast:
        logits = teacher(x.contiguous(memory_format=memory_format))
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


class EmaPairs:
    """The teacher/student tensor lists, gathered once so that each update is one fused call."""

    def __init__(self, teacher: nn.Module, student: nn.Module):
        t_params, s_params = list(teacher.parameters()), list(student.parameters())
        t_bufs, s_bufs = list(teacher.buffers()), list(student.buffers())
        if len(t_params) != len(s_params) or len(t_bufs) != len(s_bufs):
            raise ValueError("teacher and student must have the same structure")
        self.teacher_float = t_params + [b for b in t_bufs if b.is_floating_point()]
        self.student_float = s_params + [b for b in s_bufs if b.is_floating_point()]
        self.teacher_other = [b for b in t_bufs if not b.is_floating_point()]
        self.student_other = [b for b in s_bufs if not b.is_floating_point()]

    def select(self, keep: Callable[[torch.Tensor], bool], counters: bool) -> "EmaPairs":
        """The pairs whose student tensor ``keep`` accepts, and the integer buffers if ``counters``: a part of
        the update, in the same order."""
        part = copy.copy(self)
        pairs = [(t, s) for t, s in zip(self.teacher_float, self.student_float) if keep(s)]
        part.teacher_float, part.student_float = [t for t, _ in pairs], [s for _, s in pairs]
        part.teacher_other, part.student_other = (self.teacher_other, self.student_other) if counters else ([], [])
        return part


def ema_weight(alpha: float | torch.Tensor) -> float | torch.Tensor:
    """1 - alpha as float32 arithmetic needs it: 1 - float32(alpha), so the two weights sum to exactly 1
    (exact for alpha >= 0.5), and the teacher of a constant student converges to it, not to a scaled copy."""
    if isinstance(alpha, torch.Tensor):
        return 1.0 - alpha.float()
    return 1.0 - struct.unpack("f", struct.pack("f", alpha))[0]


@torch.no_grad()
def ema_update_(pairs: EmaPairs, alpha: float | torch.Tensor, weight: float | torch.Tensor | None = None) -> None:
    """teacher <- alpha * teacher + weight * student, weight = ``ema_weight(alpha)``, in place, in fused calls.

    ``alpha`` and ``weight`` may be 0-dim tensors on the device, as in a captured CUDA graph (no host
    synchronisation). Host floats and device scalars filled from the same floats give bit-identical
    results, so a captured step and an eager one agree exactly.
    """
    weight = ema_weight(alpha) if weight is None else weight
    torch._foreach_mul_(pairs.teacher_float, alpha)
    torch._foreach_add_(pairs.teacher_float, torch._foreach_mul(pairs.student_float, weight))
    if pairs.teacher_other:   # batch norm's step counters: one fused copy, not one kernel each
        torch._foreach_copy_(pairs.teacher_other, pairs.student_other)
