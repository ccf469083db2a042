"""Consistency losses and confidence thresholding, as pure tensor functions.

"Milking CowMask for Semi-Supervised Image Classification", French, Oliver, Salimans,
arXiv:2003.12022, Algorithms 2 and 3; semantics of the authors' implementation
(``../shared/reference/cowmask-reference.md`` sections 3.3 and 3.4).

Teacher tensors passed here must come from ``torch.no_grad()``; only the student's logits carry
gradient.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 if it is narrower (bf16 logits under autocast), else as it is."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def squared_error(student_logits: torch.Tensor, target_probs: torch.Tensor,
                  weight: torch.Tensor) -> torch.Tensor:
    """(1/B) sum_i w_i sum_c (softmax(s)_ic - t_ic)^2: divided by the full batch, not by the passing count.

    Args:
        student_logits: (B, C).
        target_probs: (B, C) teacher probabilities (no gradient).
        weight: (B,) per-sample weights, or a scalar tensor.
    Returns:
        scalar loss (float32, or float64 for float64 logits).
    """
    diff = F.softmax(wide(student_logits), dim=1) - wide(target_probs)
    per_sample = (diff * diff).sum(dim=1)
    return (per_sample * weight).mean()


def confidence_weight(confidence: torch.Tensor, threshold: float | torch.Tensor,
                      average: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Which samples are confident enough to train on.

    pass_i = confidence_i > threshold (strict); a threshold <= 0 lets every sample pass.

    Args:
        confidence: (B,) confidence of the teacher.
        threshold: a number or a 0-d tensor (compiled code then serves every threshold).
        average: False gives the per-sample 0/1 mask; True gives the fraction passing as one
            scalar weight for the whole batch (the reference's choice for mixing).
    Returns:
        (weight, pass_rate): weight is (B,) or a scalar tensor; pass_rate a scalar tensor.
    """
    passed = ((confidence > threshold) | (threshold <= 0)).to(confidence.dtype)
    rate = passed.mean()
    return (rate if average else passed), rate


def mix_targets(teacher_logits: torch.Tensor, blend: torch.Tensor, mix_logits: bool,
                conf_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher target and confidence for images mixed with their batch neighbour (roll by one).

    Partner of sample i is sample (i + 1) mod B, as in ``torch.roll(x, -1, 0)``.

    Args:
        teacher_logits: (B, C) teacher logits on the unmixed images.
        blend: (B,) fraction of each mixed image taken from the partner.
        mix_logits: blend logits then softmax, instead of blending probabilities.
        conf_mode: "mix_conf" blends the two max-probabilities; "mix_prob" takes the max of the
            blended target.
    Returns:
        (target_probs (B, C), confidence (B,)).
    """
    lam = wide(blend)[:, None]
    logits0 = wide(teacher_logits)
    logits1 = torch.roll(logits0, shifts=-1, dims=0)
    p0 = F.softmax(logits0, dim=1)
    p1 = torch.roll(p0, shifts=-1, dims=0)
    target = F.softmax(logits0 + (logits1 - logits0) * lam, dim=1) if mix_logits else p0 + (p1 - p0) * lam
    if conf_mode == "mix_conf":
        c0 = p0.max(dim=1).values
        c1 = p1.max(dim=1).values
        confidence = c0 + (c1 - c0) * lam[:, 0]
    elif conf_mode == "mix_prob":
        confidence = target.max(dim=1).values
    else:
        raise ValueError(f"conf_mode must be 'mix_conf' or 'mix_prob', got {conf_mode!r}")
    return target, confidence
