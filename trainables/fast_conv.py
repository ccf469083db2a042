"""3x3 convolutions through our own Triton kernels (``trainables.conv_triton``) instead of cuDNN.

cuDNN runs the narrow convolutions of a WRN-28-2 step (32-128 channels, NHWC, bf16) at 10-33% of
their memory bound on an H100 (3-10x slower than it). ``use_triton_convs(model)`` switches every
eligible layer (3x3, stride 1, padding 1, no bias, 32 or more input channels, channel counts a
multiple of 16) to ``TritonConv2d``: the same parameters and state dict, computed through the
``cowtune::conv3x3`` operator. On CUDA that operator runs the Triton kernels; elsewhere it runs
PyTorch's own convolution, so a model switched on one device still runs (and is tested) on
another. torch.compile keeps the operator whole, as it does cuDNN's; its backward
(``cowtune::conv3x3_backward``) returns both gradients.

The trainer switches a model when ``train.conv_kernels`` is "triton" (off by default): in the
captured WRN-28-2 CowMix step on an H100 it gained 0.9% (README, "Performance"), less than it costs
in autotuning per process and bit-exactness (the weight gradient sums with float atomics).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

MIN_CHANNELS = 32   # the narrowest convolutions measured (WRN-28-2's first stage); 16 is left to cuDNN
CHANNEL_MULTIPLE = 16   # the kernels' tensor-core tiles


def _format_of(x: Tensor) -> torch.memory_format:
    """channels_last for an NHWC tensor, else contiguous: the layout an output keeps from its input."""
    nhwc = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    return torch.channels_last if nhwc else torch.contiguous_format


def _output_format(x: Tensor) -> torch.memory_format:
    return torch.channels_last if x.device.type == "cuda" else _format_of(x)


@torch.library.custom_op("cowtune::conv3x3", mutates_args=())
def conv3x3(x: Tensor, w: Tensor) -> Tensor:
    """conv2d(x, w, padding=1) for a (K, C, 3, 3) weight, without bias, computed in x's dtype (the weight
    is cast to it, as autocast casts a convolution's weight)."""
    return F.conv2d(x, w.to(x.dtype), padding=1).contiguous(memory_format=_format_of(x))


@conv3x3.register_kernel("cuda")
def _conv3x3_cuda(x: Tensor, w: Tensor) -> Tensor:
    from trainables import conv_rows
    from trainables.conv_triton import conv3x3_fwd_packed, pack_weight

    x = x.contiguous(memory_format=torch.channels_last)
    cfg = conv_rows.config_for("fprop", x.shape[1], w.shape[0], x.shape[2], x.shape[3])
    if cfg is not None:
        return conv_rows.conv3x3_rows_fwd(x, pack_weight(w, x.dtype), config=cfg)
    return conv3x3_fwd_packed(x, pack_weight(w, x.dtype))


@conv3x3.register_fake
def _conv3x3_fake(x: Tensor, w: Tensor) -> Tensor:
    n, _, h, wd = x.shape
    return torch.empty((n, w.shape[0], h, wd), dtype=x.dtype, device=x.device).contiguous(
        memory_format=_output_format(x))


@torch.library.custom_op("cowtune::conv3x3_backward", mutates_args=())
def conv3x3_backward(dy: Tensor, x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """(dx, dw) of ``conv3x3(x, w)`` for the output gradient ``dy``; dw in w's dtype."""
    dx, dw, _ = torch.ops.aten.convolution_backward(dy, x, w.to(x.dtype), None, [1, 1], [1, 1], [1, 1], False,
                                                    [0, 0], 1, [True, True, False])
    return dx.contiguous(memory_format=_format_of(x)), dw.to(w.dtype).contiguous(memory_format=_format_of(w))


@conv3x3_backward.register_kernel("cuda")
def _conv3x3_backward_cuda(dy: Tensor, x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    from trainables import conv_rows
    from trainables.conv_triton import conv3x3_dgrad, conv3x3_wgrad, pack_weight

    dy = dy.contiguous(memory_format=torch.channels_last)
    x = x.contiguous(memory_format=torch.channels_last)
    shape = (x.shape[1], w.shape[0], x.shape[2], x.shape[3])
    cfg = conv_rows.config_for("dgrad", *shape)
    if cfg is not None:
        dx = conv_rows.conv3x3_rows_fwd(dy, pack_weight(w, dy.dtype, for_dgrad=True), config=cfg)
    else:
        dx = conv3x3_dgrad(dy, w)
    cfg = conv_rows.config_for("wgrad", *shape)
    dw = conv_rows.conv3x3_rows_wgrad(dy, x, config=cfg) if cfg is not None else conv3x3_wgrad(dy, x)
    return dx, dw.to(w.dtype).contiguous(memory_format=_format_of(w))


@conv3x3_backward.register_fake
def _conv3x3_backward_fake(dy: Tensor, x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    return (torch.empty_like(x, memory_format=_output_format(x)),
            torch.empty_like(w, memory_format=_format_of(w)))


def _setup_context(ctx, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy: Tensor) -> tuple[Tensor, Tensor]:
    x, w = ctx.saved_tensors
    return torch.ops.cowtune.conv3x3_backward(dy, x, w)


conv3x3.register_autograd(_backward, setup_context=_setup_context)


class TritonConv2d(nn.Conv2d):
    """An ``nn.Conv2d`` (3x3, stride 1, padding 1, no bias) computed by ``cowtune::conv3x3``. Under autocast
    the input is cast as autocast casts a convolution's; the weight is cast inside the operator, while it
    is packed for the kernels, and its gradient comes back in the weight's own dtype."""

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return torch.ops.cowtune.conv3x3(x, self.weight)


def eligible(m: nn.Module) -> bool:
    """Whether ``m`` is a convolution the Triton kernels compute."""
    return (type(m) is nn.Conv2d and m.kernel_size == (3, 3) and m.stride == (1, 1) and m.padding == (1, 1)
            and m.dilation == (1, 1) and m.groups == 1 and m.bias is None and m.padding_mode == "zeros"
            and m.in_channels >= MIN_CHANNELS and m.in_channels % CHANNEL_MULTIPLE == 0
            and m.out_channels % CHANNEL_MULTIPLE == 0)


def apply_conv_kernels(model: nn.Module, conv_kernels: str, device: torch.device) -> int:
    """Switch ``model`` as ``train.conv_kernels`` asks: to the Triton kernels when it says "triton" and the
    model trains on CUDA (elsewhere they would only run PyTorch's convolution); returns how many layers."""
    return use_triton_convs(model) if conv_kernels == "triton" and device.type == "cuda" else 0


def use_triton_convs(model: nn.Module) -> int:
    """Switch ``model``'s eligible convolutions to ``TritonConv2d`` in place (parameters, buffers and
    state-dict keys unchanged); returns how many were switched."""
    count = 0
    for m in model.modules():
        if eligible(m):
            m.__class__ = TritonConv2d
            count += 1
    return count
