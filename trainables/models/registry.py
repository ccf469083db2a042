"""The model registry: ``register_model`` adds a builder under a name, ``create_model`` builds one.

The families register themselves when ``trainables.models`` imports them (wrn, shakeshake, torchvision_resnets, cnn).
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from trainables.models.segmented_bn import convert_batch_norm
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
    batches into one call (``trainables.models.segmented_bn``).

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
