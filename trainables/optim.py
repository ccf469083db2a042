"""Optimiser and learning-rate schedule of the reference implementation.

SGD with Nesterov momentum; coupled L2 on conv and linear weights only (PyTorch ``weight_decay``
on a parameter group holding just those); base LR = lr_per_256 * batch / 256; stepped schedule
with absolute factors, or a half cosine; optional linear warm-up. The schedule is a pure function
of the 0-based step, so resume needs no scheduler state.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from trainables.config import OptimConfig, TrainConfig


def is_kernel(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s parameter ``name`` is a conv or linear weight, the ones the L2 penalty covers."""
    return name == "weight" and isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear))


def make_optimizer(model: nn.Module, cfg: OptimConfig, batch_size: int) -> torch.optim.SGD:
    """SGD over two groups, in ``model.modules()`` order: the kernels (with L2), then every other parameter."""
    decay, no_decay = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            (decay if is_kernel(module, name) else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.l2}, {"params": no_decay, "weight_decay": 0.0}]
    base = cfg.lr_per_256 * batch_size / 256
    fused = next(model.parameters()).is_cuda  # one kernel for the whole update instead of a few per group
    return torch.optim.SGD(groups, lr=base, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0,
                           fused=fused or None)


def lr_factor(step: int, steps_per_epoch: int, cfg: OptimConfig, warmup: bool = True) -> float:
    """Multiplier of the base learning rate at 0-based optimiser ``step``.

    stepped: factor v_k of the last boundary round(epoch_k * steps_per_epoch) strictly below step
    (so a change takes effect at boundary + 1); cosine: 0.5 + 0.5 cos(pi s / (half * spe));
    warm-up multiplies by min(1, s / (warmup_epochs * spe)).
    """
    if cfg.schedule == "constant":
        factor = 1.0
    elif cfg.schedule == "stepped":
        factor = 1.0
        for epoch, value in cfg.steps:
            if round(epoch * steps_per_epoch) < step:
                factor = value
    else:
        factor = 0.5 + 0.5 * math.cos(math.pi * step / (cfg.cosine_half_epochs * steps_per_epoch))
    if warmup and cfg.warmup_epochs > 0:
        factor *= min(1.0, step / (cfg.warmup_epochs * steps_per_epoch))
    return factor


def step_schedule(cfg: TrainConfig, step: int, steps_per_epoch: int, base_lr: float) -> tuple[float, float]:
    """(learning rate, teacher EMA alpha) at 0-based ``step``; with ``teacher.anneal`` (1 - alpha)
    follows the learning-rate schedule's shape without warm-up, as in the reference."""
    lr = base_lr * lr_factor(step, steps_per_epoch, cfg.optim)
    alpha = cfg.teacher.alpha
    if cfg.teacher.anneal:
        alpha = 1.0 - (1.0 - alpha) * lr_factor(step, steps_per_epoch, cfg.optim, warmup=False)
    return lr, alpha
