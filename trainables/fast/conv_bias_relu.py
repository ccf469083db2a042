"""``relu(conv2d(x, w, b))`` as one cuDNN call on CUDA, for forwards that need no gradient.

Inductor computes a convolution followed by a bias and a ReLU as cuDNN's plain convolution and a Triton kernel that
adds the bias and clamps: one more pass over the output, read and written. cuDNN's fused form
(``torch.cudnn_convolution_relu``) applies both in the convolution's epilogue. Measured on an NVIDIA H100 80GB HBM3,
2026-11-27, bf16, channels_last, N=256, a shake-shake teacher's stacked first convolutions: 96 -> 192 channels at
32x32 151 us against 395 for conv, bias and ReLU as three eager kernels; 192 -> 384 at 16x16 124 against 240
(``benchmarks/shakeshake_convs.py``, in history at 3a6369c). In the shake-shake teacher
(``model_swaps.FastShakeShakeBlock.folded``) the whole fold gave +1.6% in the CowMix step (docs/journal/2026-11-27.md).

``cowtune::conv_bias_relu`` wraps it as an operator torch.compile keeps whole (it has no meta kernel of its own to
trace). It has no autograd formula: ``conv_bias_relu`` calls it only where no gradient is wanted, on CUDA, and
without deterministic algorithms asked for (``fused_wanted``), and computes ``F.relu(F.conv2d(...))`` otherwise, so
a caller never needs to care. Where cuDNN has no fused engine for a case, the operator warns once and computes it
unfused.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from trainables.fast.wgrad_stream import conv_format, empty_conv_output


@torch.library.custom_op("cowtune::conv_bias_relu", mutates_args=())
def _fused(x: Tensor, w: Tensor, b: Tensor, stride: list[int], padding: list[int]) -> Tensor:
    try:
        y = torch.cudnn_convolution_relu(x, w, b, stride, padding, [1, 1], 1)
    except RuntimeError as err:   # no fused engine for this shape, dtype or layout: the same values, unfused
        _warn_unfused(x, w, stride, padding, err)
        y = F.relu(F.conv2d(x, w, b, stride, padding))
    return y.contiguous(memory_format=conv_format(x, w))   # the layout the fake below promises


@_fused.register_fake
def _(x: Tensor, w: Tensor, b: Tensor, stride: list[int], padding: list[int]) -> Tensor:
    return empty_conv_output(x, w, stride, padding)


_WARNED: set[tuple] = set()


def _warn_unfused(x: Tensor, w: Tensor, stride: list[int], padding: list[int], err: RuntimeError) -> None:
    key = (tuple(x.shape), tuple(w.shape), tuple(stride), tuple(padding), x.dtype, conv_format(x, w))
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"cuDNN has no fused convolution + bias + ReLU for input {tuple(x.shape)} {x.dtype}, weight "
                      f"{tuple(w.shape)}; computing it unfused ({str(err).splitlines()[0]})", stacklevel=3)


def fused_wanted(x: Tensor, w: Tensor, b: Tensor) -> bool:
    """Whether ``conv_bias_relu`` calls cuDNN's fused form: on CUDA with cuDNN on, no gradient wanted (the fused
    operator has no backward), and no deterministic algorithms asked for (PyTorch calls it without cuDNN's
    deterministic flag)."""
    return (x.is_cuda and torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled
            and not torch.backends.cudnn.deterministic and not torch.are_deterministic_algorithms_enabled()
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or b.requires_grad)))


def conv_bias_relu(x: Tensor, w: Tensor, b: Tensor, stride: tuple[int, ...] | list[int],
                   padding: tuple[int, ...] | list[int]) -> Tensor:
    """``F.relu(F.conv2d(x, w, b, stride, padding))``, as one cuDNN call where ``fused_wanted``. Under autocast ``x``
    is cast as autocast casts a convolution's input; ``w`` and ``b`` are cast to ``x``'s dtype (cuDNN wants one)."""
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    w, b = w.to(x.dtype), b.to(x.dtype)
    if fused_wanted(x, w, b):
        return _fused(x, w, b, list(stride), list(padding))
    return F.relu(F.conv2d(x, w, b, stride, padding))
