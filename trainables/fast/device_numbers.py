"""Numbers as device tensors: what the fast path passes to the plain step's named arguments (omega and psi, the
regularizers' ranges and scales) so that compiled code and a captured CUDA graph serve every trial's numbers.
"""
from __future__ import annotations

import functools
from typing import Any

import torch


def device_constants(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """``values`` as a tensor of the default float type on ``device``, made once and kept. A mask's numbers
    (ranges, scales; and the step's loss weights and thresholds, ``trainables.step``) reach the arithmetic
    after the random draws as a tensor, so that code compiled for it serves every trial's numbers; and a CUDA
    graph capture cannot copy from the host: the passes before it make the tensor. Kept for the life of the
    process (a few bytes each): a captured graph reads the tensor but does not hold it."""
    return _constants(tuple(float(v) for v in values), torch.device(device), torch.get_default_dtype())


@functools.cache
def _constants(values: tuple[float, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"the device constants {values} were first asked for while a CUDA graph captures, "
                           "which cannot copy them from the host: make them in the passes before the capture")
    return torch.tensor(values, dtype=dtype, device=device)


def on_device(numbers: tuple, device: torch.device) -> tuple:
    """A NamedTuple of floats as 0-d views of one device tensor, by the same names (``device_constants``: made once
    and kept). Compiled code reads the tensor, so one compilation serves every trial's numbers; a captured CUDA
    graph reads it too, where it could not copy a number from the host."""
    return numbers._make(device_constants(tuple(numbers), device).unbind())


def draws_on_device(draws: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A regularizer's draws with its numbers (its NamedTuples of floats) on ``device`` (``on_device``)."""
    return {k: on_device(v, device) if isinstance(v, tuple) else v for k, v in draws.items()}
