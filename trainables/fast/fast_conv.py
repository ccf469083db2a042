"""3x3 convolutions through our own Triton kernels (``trainables.fast.conv_rows``) where they beat cuDNN.

cuDNN runs the narrow convolutions of a WRN-28-2 step (32-128 channels, NHWC, bf16) at 10-33% of
their memory bound on an H100. ``use_triton_convs(model)`` switches every eligible layer (3x3,
stride 1, padding 1, a power-of-two number of input channels or 1-3 (a stem's, on images), output
channels a multiple of 16; a bias is added after the convolution, where Inductor fuses it into the
next kernel) to ``TritonConv2d``: the same parameters and state dict, computed through the
``cowtune::conv3x3`` operator. On CUDA that operator runs the row-streaming kernels for the ops and
shapes in their measured table (``conv_rows.CONFIGS``: WRN-28-2's stem and 16-, 32- and 64-channel layers, the
shake-shake WRN-26's stem and 16 -> 96 layers) and
cuDNN for the rest; elsewhere it runs PyTorch's own convolution, so a model switched on one device
still runs (and is tested) on another. torch.compile keeps the operator whole, as it does cuDNN's;
its backward (``cowtune::conv3x3_backward``) returns both gradients (the input's only where it needs one: not
for a stem on the images). The kernels are deterministic
(the weight gradient adds per-program partial sums, no atomics).

The trainer switches a model when ``train.fast.conv_kernels`` is "triton" (the default), each step is one
CUDA graph (``train.fast.cuda_graph: step``, the default on CUDA) and it trains on a GPU of the compute
capability the table was measured on (9.x: H100, H200): in the captured WRN-28-2 CowMix step on an
H100, 137.2 -> 155.7 steps/s (docs/journal/2026-11-27.md).
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainables.fast.wgrad_stream import SWITCHED_CONVS, format_of, on_side, switch_convs
from trainables.models.layers import SameConv2d

CHANNEL_MULTIPLE = 16   # output channels: the kernels' tensor-core tiles


def output_format(x: Tensor) -> torch.memory_format:
    """The row kernels' output layout: channels_last on CUDA (where they, or cuDNN in their place, compute it),
    else the input's."""
    return torch.channels_last if x.device.type == "cuda" else format_of(x)


@torch.library.custom_op("cowtune::conv3x3", mutates_args=())
def conv3x3(x: Tensor, w: Tensor, w_lo: Tensor) -> Tensor:
    """conv2d(x, w, padding=1) for a (K, C, 3, 3) weight, without bias, computed in x's dtype with ``w_lo``: w
    cast to it by the caller (as autocast casts a convolution's weight; inside a compiled model, Inductor
    then casts all the weights in a few kernels, and the backward pass reuses the casts). The gradient goes
    to w, in w's dtype."""
    return F.conv2d(x, w_lo, padding=1).contiguous(memory_format=format_of(x))


_FELL_BACK: set[tuple] = set()   # (op, N, C, K, H, W) whose row kernel cannot run on this GPU


def _key(op: str, x_shape, c: int, k: int) -> tuple[str, int, int, int, int, int]:
    """(op, N, C, K, H, W) of ``op`` of a C -> K layer on an input of ``x_shape``."""
    return op, x_shape[0], c, k, x_shape[2], x_shape[3]


def _table_config(key: tuple[str, int, int, int, int, int]) -> dict[str, int] | None:
    """The row kernels' table configuration for ``key`` (``_key``), or None where cuDNN computes it: the table has
    no entry, or the kernel could not run on this GPU."""
    from trainables.fast import conv_rows

    return None if key in _FELL_BACK else conv_rows.tuned_config(*key)


def _rows(op: str, x_shape, c: int, k: int, run) -> Tensor | None:
    """``run(config)`` with ``_table_config``, or None where cuDNN should compute it (no configuration, or the
    kernel cannot run on this GPU: not enough shared memory, say; warned once, cuDNN from then on)."""
    from triton.runtime.errors import OutOfResources

    key = _key(op, x_shape, c, k)
    cfg = _table_config(key)
    if cfg is None:
        return None
    try:
        return run(cfg)
    except OutOfResources as e:
        _FELL_BACK.add(key)
        warnings.warn(f"cowtune: the Triton {op} kernel for {key[1:]} (N, C, K, H, W) cannot run here "
                      f"({type(e).__name__}: {str(e)[:200]}); using cuDNN for it", RuntimeWarning, stacklevel=3)
        return None


@conv3x3.register_kernel("cuda")
def _conv3x3_cuda(x: Tensor, w: Tensor, w_lo: Tensor) -> Tensor:
    from trainables.fast import conv_rows

    x = x.contiguous(memory_format=torch.channels_last)
    y = _rows("fprop", x.shape, x.shape[1], w.shape[0], lambda cfg: conv_rows.conv3x3_rows_fwd(x, w_lo, config=cfg))
    if y is None:
        y = F.conv2d(x, w_lo, padding=1).contiguous(memory_format=torch.channels_last)
    return y


@conv3x3.register_fake
def _conv3x3_fake(x: Tensor, w: Tensor, w_lo: Tensor) -> Tensor:
    n, _, h, wd = x.shape
    return torch.empty((n, w.shape[0], h, wd), dtype=x.dtype, device=x.device).contiguous(
        memory_format=output_format(x))


@torch.library.custom_op("cowtune::conv3x3_backward", mutates_args=())
def conv3x3_backward(dy: Tensor, x: Tensor, w: Tensor, w_lo: Tensor, input_grad: bool) -> tuple[Tensor, Tensor]:
    """(dx, dw) of ``conv3x3(x, w, w_lo)`` for the output gradient ``dy``; dw in w's dtype; dx empty unless
    ``input_grad`` (a model's first layer: its input, the images, needs none)."""
    dx, dw, _ = torch.ops.aten.convolution_backward(dy, x, w_lo, None, [1, 1], [1, 1], [1, 1], False,
                                                    [0, 0], 1, [input_grad, True, False])
    dx = dx.contiguous(memory_format=format_of(x)) if input_grad else x.new_empty(0)
    return dx, dw.to(w.dtype).contiguous(memory_format=format_of(w))


def _weight_grad(dy: Tensor, x: Tensor, w: Tensor, w_lo: Tensor) -> Tensor:
    """dw of ``conv3x3(x, w, w_lo)`` in w's dtype and layout: the row kernel's (float32) or cuDNN's."""
    from trainables.fast import conv_rows

    c, k = x.shape[1], w.shape[0]
    dw = _rows("wgrad", x.shape, c, k, lambda cfg: conv_rows.conv3x3_rows_wgrad(dy, x, config=cfg))
    if dw is None:
        dw = torch.ops.aten.convolution_backward(dy, x, w_lo, None, [1, 1], [1, 1], [1, 1], False,
                                                 [0, 0], 1, [False, True, False])[1]
    return dw.to(w.dtype).contiguous(memory_format=format_of(w))


@conv3x3_backward.register_kernel("cuda")
def _conv3x3_backward_cuda(dy: Tensor, x: Tensor, w: Tensor, w_lo: Tensor, input_grad: bool) -> tuple[Tensor, Tensor]:
    dy = dy.contiguous(memory_format=torch.channels_last)
    x = x.contiguous(memory_format=torch.channels_last)
    # on the side stream if it is on (trainables.fast.wgrad_stream), forked before the input gradient
    dw = on_side(lambda: _weight_grad(dy, x, w, w_lo), dy, x, w_lo)
    dx = _input_grad(dy, x, w_lo) if input_grad else x.new_empty(0)
    if dw is None:
        dw = _weight_grad(dy, x, w, w_lo)
    return dx, dw


def _input_grad(dy: Tensor, x: Tensor, w_lo: Tensor) -> Tensor:
    """dx of ``conv3x3`` (channels_last): the row kernel's, or cuDNN's where the row kernels do not compute it."""
    from trainables.fast import conv_rows

    dx = _rows("dgrad", x.shape, x.shape[1], w_lo.shape[0],
               lambda cfg: conv_rows.conv3x3_rows_dgrad(dy, w_lo, config=cfg))
    if dx is None:
        dx = torch.ops.aten.convolution_backward(dy, x, w_lo, None, [1, 1], [1, 1], [1, 1], False,
                                                 [0, 0], 1, [True, False, False])[0]
    return dx.contiguous(memory_format=torch.channels_last)


@conv3x3_backward.register_fake
def _conv3x3_backward_fake(dy: Tensor, x: Tensor, w: Tensor, w_lo: Tensor, input_grad: bool) -> tuple[Tensor, Tensor]:
    dx = torch.empty_like(x, memory_format=output_format(x)) if input_grad else x.new_empty(0)
    return dx, torch.empty_like(w, memory_format=format_of(w))


def _setup_context(ctx, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy: Tensor) -> tuple[Tensor | None, Tensor, None]:
    x, w, w_lo = ctx.saved_tensors
    dx, dw = torch.ops.cowtune.conv3x3_backward(dy, x, w, w_lo, ctx.needs_input_grad[0])
    return (dx if ctx.needs_input_grad[0] else None), dw, None


conv3x3.register_autograd(_backward, setup_context=_setup_context)


class TritonConv2d(nn.Conv2d):
    """An ``nn.Conv2d`` (3x3, stride 1, padding 1) computed by ``cowtune::conv3x3``, its bias (if any) added after
    it. Under autocast the input is cast as autocast casts a convolution's, and the weight and bias to the input's
    dtype; their gradients come back in their own dtype. A subclass of ``nn.Conv2d`` (the models' ``SameConv2d``
    at stride 1) is switched to a subclass of both (``wgrad_stream.switched_class``)."""

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        y = torch.ops.cowtune.conv3x3(x, self.weight, self.weight.to(x.dtype))
        return y if self.bias is None else y + self.bias.to(y.dtype).view(1, -1, 1, 1)


SWITCHED_CONVS.append(TritonConv2d)


def _plain_convolution(m: nn.Module, same_and_biased: bool) -> bool:
    """``nn.Conv2d`` itself without bias; with ``same_and_biased``, with a bias too, and the models' ``SameConv2d`` (or
    a subclass that keeps its forward and convolution) at stride 1, whose "SAME" padding is then the symmetric
    ``padding`` (``dynamic_pad`` False)."""
    if type(m) is nn.Conv2d:
        return m.bias is None or same_and_biased
    if not same_and_biased:
        return False
    return (isinstance(m, SameConv2d) and not m.dynamic_pad and type(m).forward is SameConv2d.forward
            and type(m)._conv_forward is nn.Conv2d._conv_forward)


def eligible(m: nn.Module, same_and_biased: bool = True) -> bool:
    """Whether ``m`` is a convolution the Triton kernels compute: ``nn.Conv2d`` without bias, and with
    ``same_and_biased`` (``switch.FastSwitches``, the trainer's default) also one with a bias and the models'
    ``SameConv2d`` at stride 1."""
    return (_plain_convolution(m, same_and_biased) and not isinstance(m, TritonConv2d) and m.kernel_size == (3, 3)
            and m.stride == (1, 1) and m.padding == (1, 1) and m.dilation == (1, 1) and m.groups == 1
            and m.padding_mode == "zeros"
            and (m.in_channels < 4 or not m.in_channels & (m.in_channels - 1))   # 1-3: an image's channels
            and m.out_channels % CHANNEL_MULTIPLE == 0)


def computes_on_rows(conv: nn.Module, x: Tensor) -> bool:
    """Whether ``conv``'s forward on ``x`` runs a row kernel: a switched layer, on CUDA, whose shape the kernels'
    table holds (else cuDNN's, through the same operator)."""
    return (isinstance(conv, TritonConv2d) and x.device.type == "cuda"
            and _table_config(_key("fprop", x.shape, x.shape[1], conv.out_channels)) is not None)


def apply_conv_kernels(model: nn.Module, conv_kernels: str, cuda_graph: str, device: torch.device,
                       same_and_biased: bool = True) -> int:
    """Switch ``model`` as ``train.fast.conv_kernels`` asks: to the Triton kernels when it says "triton", the model
    trains on a CUDA GPU of the compute capability their table was measured on (elsewhere the operator would
    only run cuDNN's or PyTorch's convolution) and each step is one CUDA graph (``cuda_graph`` "step": launched
    one by one, every Triton kernel pays its Python launcher; our earlier Triton convolutions ran a step without
    the graph at 28-31 steps/s against cuDNN's 48-51 on an H100); the layers ``eligible`` takes with
    ``same_and_biased``; returns how many."""
    if conv_kernels != "triton" or cuda_graph != "step" or device.type != "cuda":
        return 0
    from trainables.fast.conv_rows import TUNED_CAPABILITY

    if torch.cuda.get_device_capability(device)[0] != TUNED_CAPABILITY:   # the one gate: the table holds
        return 0                                                           # no configurations for it
    return use_triton_convs(model, same_and_biased)


def use_triton_convs(model: nn.Module, same_and_biased: bool = True) -> int:
    """Switch ``model``'s convolutions that ``eligible`` takes (with ``same_and_biased``) to ``TritonConv2d``; returns
    how many were switched."""
    return switch_convs(model, functools.partial(eligible, same_and_biased=same_and_biased), TritonConv2d)
