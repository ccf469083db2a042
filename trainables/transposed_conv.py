"""Some convolutions' forward pass computed as a transposed convolution, where cuDNN runs that form faster.

A stride-1 convolution ``y = conv2d(x, w, padding=p)`` with a k x k kernel and ``p = (k - 1) / 2`` ("same"
padding) is also the transposed convolution of ``x`` with the weight's input and output axes swapped and its
taps flipped: ``y = conv_transpose2d(x, w.transpose(0, 1).flip(2, 3), padding=p)``. The two sum the same products;
only the order of the sums (and so the last bits of a rounded result) may differ. cuDNN computes a transposed
convolution with its input-gradient kernels, and for some shapes those run faster than its forward kernels
(``benchmarks/conv_gemm_bound.py``, NVIDIA H100 80GB HBM3, bf16, channels_last, 512 images, 2026-11-28; alone):

    96 -> 96 at 32x32 (the shake-shake model's first stage):    228-230 us forward, 168-169 us transposed
    192 -> 192 at 16x16 (its second stage):                     145-158 us, 138-142 us
    384 -> 384 at 8x8:                                          133 us, 131 us (no gain: not taken)
    192 -> 384 at 16x16:                                        240 us, 270 us (slower)

``cowtune::conv2d`` (``trainables.wgrad_stream``, the student's convolutions when the weight gradients run on a
side stream) takes the transposed form for the shapes in ``SHAPES`` while ``TransposedForward.on``, on a GPU of
compute capability ``CAPABILITY`` (Hopper: measured on an H100 only); everything else, and its backward pass, is as
before. An experiment: one short A/B run of the shake-shake step measured no change (docs/performance.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# (input channels, output channels, height, width) of the stride-1 3x3 convolutions taken, measured on an H100
SHAPES = frozenset({(96, 96, 32, 32), (192, 192, 16, 16)})
CAPABILITY = 9


class TransposedForward:
    """The switch, for A/B timings (benchmarks/step_ab.py); read when a convolution runs (once, when captured)."""
    on = False


def transposed_weight(w: Tensor, memory_format: torch.memory_format) -> Tensor:
    """The weight of the transposed convolution computing ``conv2d`` with ``w``: in/out axes swapped, taps flipped."""
    return w.transpose(0, 1).flip(2, 3).contiguous(memory_format=memory_format)


def conv2d_as_transposed(x: Tensor, w: Tensor, padding: list[int], weight_format: torch.memory_format) -> Tensor:
    """``F.conv2d(x, w, padding=padding)`` (stride 1, "same" padding) as the transposed convolution, its weight made
    in ``weight_format`` (the input's layout, so cuDNN copies neither)."""
    if any(k != 2 * p + 1 for k, p in zip(w.shape[2:], padding)):
        raise ValueError(f"conv2d_as_transposed needs 'same' padding: kernel {tuple(w.shape[2:])}, padding {padding}")
    return F.conv_transpose2d(x, transposed_weight(w, weight_format), None, 1, padding)


def shape_taken(x_shape: tuple[int, ...], w_shape: tuple[int, ...], stride: list[int], padding: list[int]) -> bool:
    """Whether a convolution of an input of ``x_shape`` with a weight of ``w_shape`` is one of ``SHAPES``: 3x3,
    stride 1, padding 1, (input channels, output channels, height, width) listed."""
    return (list(stride) == [1, 1] and list(padding) == [1, 1] and tuple(w_shape[2:]) == (3, 3)
            and (w_shape[1], w_shape[0], *x_shape[2:]) in SHAPES)


def taken(x: Tensor, w: Tensor, stride: list[int], padding: list[int]) -> bool:
    """Whether the forward of ``conv2d(x, w, stride=stride, padding=padding)`` runs as the transposed convolution:
    the switch is on, ``x`` is on a GPU of capability ``CAPABILITY`` and the convolution is one of ``SHAPES``."""
    return (TransposedForward.on and x.is_cuda and shape_taken(tuple(x.shape), tuple(w.shape), stride, padding)
            and torch.cuda.get_device_capability(x.device)[0] == CAPABILITY)
