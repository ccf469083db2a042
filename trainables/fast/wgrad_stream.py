"""Weight gradients on their own CUDA stream (``train.fast.wgrad_stream``).

In a convolution's backward pass, the input gradient is what the next layer back waits for; the weight
gradient is read by nobody until the optimiser. Launched on a side stream, forked from the main one just
before the input gradient, each layer's weight gradient runs beside the rest of the backward pass (the
input gradients and batch-norm backward kernels of the layers below) instead of between them. The
backward pass runs inside ``backward_on_side``, which joins the side stream when it ends, before anything
reads the gradients. The kernels are the same, so the gradients are too, bit for bit
(``benchmarks/gpu_checks.py``).

Two operators launch there: ``cowtune::conv3x3`` (our row kernels, ``trainables.fast.fast_conv``) and, for every
other convolution without bias of a model switched by ``use_stream_convs``, ``cowtune::conv2d`` (cuDNN's
kernels, as ``F.conv2d`` would run them). Nothing on the main stream may write, free or reuse what the side
stream reads before the join, nor touch a gradient it writes:

- what it reads is held until the join and recorded on it for the caching allocator, so autograd cannot
  add into it in place (it does so only to a tensor nobody else holds);
- Inductor's own reuse of buffers inside a compiled graph bypasses both, so the trainer compiles the
  student without it (``allow_buffer_reuse`` and ``inplace_buffers`` off);
- autograd sums a weight's gradients on the main stream when a weight is used more than once in a pass,
  so the trainer turns the stream on only for one stacked, compiled student call per step
  (``StepRunner``).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainables.fast.compile_lock import tag_compile_caches
from trainables.fast.cuda_streams import shared_stream

# From here on, the version of this module's operators and fast_conv's (which imports it) is part of every
# compile-cache key: the caches cannot see what an operator's backward does.
tag_compile_caches()

_on = False
_HELD: dict[int, list[Tensor]] = {}   # per device: what the side stream reads, held until the join
DELAY_CYCLES = 0   # > 0: the side stream first spins this many GPU clock cycles each time (a race check's
                   # widened window, benchmarks/gpu_checks.py; captured into a step graph like the rest)
SIDE_STREAM = True   # False: what would launch on the side stream runs on the current one (a race check's
                     # control: the same operators and kernels in one stream order, benchmarks/gpu_checks.py)


@contextlib.contextmanager
def backward_on_side(on: bool, device: torch.device) -> Iterator[None]:
    """Within: the weight gradients of ``cowtune::conv3x3`` and ``cowtune::conv2d`` launch on the side stream if
    ``on`` (a backward pass runs here). On leaving, the current stream waits for them, so the gradients can be
    read, and the tensors they read are let go."""
    global _on
    before, _on = _on, on
    try:
        yield
    finally:
        _on = before
        join_wgrad(device)


def on_side(compute: Callable[[], Tensor], *reads: Tensor) -> Tensor | None:
    """``compute()`` launched on the side stream of ``reads[0]``'s device after everything queued so far on
    the current stream, or None (nothing launched) when the side stream is off or the tensors are not on a
    GPU. ``reads``: the tensors ``compute`` reads. They are held until the join: nothing frees them, and
    autograd cannot add another gradient into one of them in place (it does that only to a tensor nobody
    else holds), before the side stream has read them."""
    if not (_on and SIDE_STREAM) or not reads[0].is_cuda:
        return None
    device = reads[0].device
    side = shared_stream(device, "wgrad")
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        if DELAY_CYCLES:
            torch.cuda._sleep(DELAY_CYCLES)
        out = compute()
    for t in reads:
        t.record_stream(side)
    _HELD.setdefault(device.index, []).extend(reads)
    return out


def join_wgrad(device: torch.device) -> None:
    """Make the current stream wait for the weight gradients launched on the side stream and let go of what
    they read (a no-op when none were launched since the last join)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index in _HELD:
            torch.cuda.current_stream(device).wait_stream(shared_stream(device, "wgrad"))
            del _HELD[index]   # after the wait: from here on the main stream's order covers the side's reads


def format_of(x: Tensor) -> torch.memory_format:
    """channels_last for an NHWC tensor, else contiguous: the layout an output keeps from its input."""
    nhwc = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    return torch.channels_last if nhwc else torch.contiguous_format


def conv_format(x: Tensor, w: Tensor) -> torch.memory_format:
    """The layout ``F.conv2d(x, w)`` gives its output (on cuDNN and on the CPU): channels_last if the input or
    the weight is, else contiguous. ``cowtune::conv2d`` keeps it, so a switched model's later layers see the
    layouts, and pick the kernels, that the unswitched model's do."""
    return torch.channels_last if torch.channels_last in (format_of(x), format_of(w)) else torch.contiguous_format


@torch.library.custom_op("cowtune::conv2d", mutates_args=())
def conv2d(x: Tensor, w: Tensor, w_lo: Tensor, stride: list[int], padding: list[int]) -> Tensor:
    """conv2d(x, w, stride=stride, padding=padding) without bias, in x's dtype with ``w_lo``: w cast to it by the
    caller (as autocast casts a convolution's weight; inside a compiled model, Inductor then casts all the
    weights in a few kernels, and the backward pass reuses the casts). The gradient goes to w, in w's dtype."""
    return F.conv2d(x, w_lo, None, stride, padding).contiguous(memory_format=conv_format(x, w))


def empty_conv_output(x: Tensor, w: Tensor, stride: list[int], padding: list[int]) -> Tensor:
    """An uninitialised tensor of the shape, dtype and layout ``F.conv2d(x, w, stride=stride, padding=padding)``
    gives: what a convolution operator's fake implementation returns."""
    size = [(n + 2 * p - k) // s + 1 for n, k, s, p in zip(x.shape[2:], w.shape[2:], stride, padding)]
    return x.new_empty([x.shape[0], w.shape[0], *size]).contiguous(memory_format=conv_format(x, w))


@conv2d.register_fake
def _conv2d_fake(x: Tensor, w: Tensor, w_lo: Tensor, stride: list[int], padding: list[int]) -> Tensor:
    return empty_conv_output(x, w, stride, padding)


def _grads(dy: Tensor, x: Tensor, w_lo: Tensor, stride: list[int], padding: list[int], mask: list[bool]):
    return torch.ops.aten.convolution_backward(dy, x, w_lo, None, stride, padding, [1, 1], False, [0, 0], 1,
                                               mask + [False])


@torch.library.custom_op("cowtune::conv2d_backward", mutates_args=())
def conv2d_backward(dy: Tensor, x: Tensor, w: Tensor, w_lo: Tensor, stride: list[int], padding: list[int],
                    input_grad: bool) -> tuple[Tensor, Tensor]:
    """(dx, dw) of ``conv2d(x, w, w_lo, stride, padding)`` for the output gradient ``dy``; dw in w's dtype and
    layout, launched on the side stream when it is on; dx empty unless ``input_grad``."""

    def weight_grad() -> Tensor:
        dw = _grads(dy, x, w_lo, stride, padding, [False, True])[1]
        return dw.to(w.dtype).contiguous(memory_format=format_of(w))

    dw = on_side(weight_grad, dy, x, w_lo)
    dx = _grads(dy, x, w_lo, stride, padding, [True, False])[0].contiguous(memory_format=conv_format(x, w)) \
        if input_grad else x.new_empty(0)
    return dx, weight_grad() if dw is None else dw


@conv2d_backward.register_fake
def _conv2d_backward_fake(dy: Tensor, x: Tensor, w: Tensor, w_lo: Tensor, stride: list[int], padding: list[int],
                          input_grad: bool) -> tuple[Tensor, Tensor]:
    dx = torch.empty_like(x, memory_format=conv_format(x, w)) if input_grad else x.new_empty(0)
    return dx, torch.empty_like(w, memory_format=format_of(w))


def _setup_context(ctx, inputs, output) -> None:
    x, w, w_lo, ctx.stride, ctx.padding = inputs
    ctx.save_for_backward(x, w, w_lo)


def _backward(ctx, dy: Tensor):
    x, w, w_lo = ctx.saved_tensors
    dx, dw = torch.ops.cowtune.conv2d_backward(dy, x, w, w_lo, ctx.stride, ctx.padding, ctx.needs_input_grad[0])
    return (dx if ctx.needs_input_grad[0] else None), dw, None, None, None


conv2d.register_autograd(_backward, setup_context=_setup_context)


class StreamConv2d(nn.Conv2d):
    """An ``nn.Conv2d`` without bias computed by ``cowtune::conv2d`` (the same kernels, its weight gradient on the
    side stream when that is on). A subclass of ``nn.Conv2d`` that keeps its convolution (TF "same" padding's,
    say) is switched to a subclass of both (``switched_class``)."""

    def _conv_forward(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if bias is not None:
            raise ValueError("StreamConv2d computes convolutions without bias (see stream_eligible)")
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return torch.ops.cowtune.conv2d(x, weight, weight.to(x.dtype), list(self.stride), list(self.padding))


# The switched convolution classes, whose weight gradients launch on the side stream when it is on: StreamConv2d,
# and fast_conv.TritonConv2d, which registers itself when its module is imported (it imports this one).
SWITCHED_CONVS: list[type] = [StreamConv2d]

_CLASSES: dict[tuple[type, type], type] = {}


def switched_class(switch: type, cls: type) -> type:
    """The class a layer of class ``cls`` is switched to: ``switch`` (a subclass of ``nn.Conv2d``: ``StreamConv2d``,
    ``fast_conv.TritonConv2d``) for ``nn.Conv2d`` itself; for a subclass of it, one subclass of both (made once,
    named e.g. StreamSameConv2d), which keeps the subclass's other methods."""
    if cls is nn.Conv2d:
        return switch
    if (switch, cls) not in _CLASSES:
        name = switch.__name__.removesuffix("Conv2d") + cls.__name__
        _CLASSES[switch, cls] = type(name, (switch, cls), {"__module__": switch.__module__})
    return _CLASSES[switch, cls]


def stream_eligible(m: nn.Module) -> bool:
    """Whether ``m`` is a convolution ``cowtune::conv2d`` computes: an ``nn.Conv2d`` (or a subclass that keeps its
    convolution) without bias, with zero padding given in numbers, no dilation or groups, not switched already
    (to this class or to the row kernels' ``TritonConv2d``). Biased ones stay as they are (the operator has no
    bias). In the shake-shake WRN, whose convolutions feeding a batch norm lost their bias, the switched layers
    train to the same weights with the side stream on, on and late, and off (``gpu_checks.py
    wgrad_stream_shakeshake``); against the unswitched model they end far apart in that check, the same whether
    the host waits for the GPU after each step or not, with deterministic cuDNN: not a race; why a probe found
    the two bit-identical to step 5 is not yet explained (docs/journal/2026-11-27.md, the shake-shake change)."""
    return (isinstance(m, nn.Conv2d) and not isinstance(m, tuple(SWITCHED_CONVS)) and m.bias is None
            and type(m)._conv_forward is nn.Conv2d._conv_forward and m.groups == 1 and m.dilation == (1, 1)
            and m.padding_mode == "zeros" and not isinstance(m.padding, str))


def switch_convs(model: nn.Module, eligible: Callable[[nn.Module], bool], switch: type) -> int:
    """Switch ``model``'s ``eligible`` convolutions to ``switch`` (``switched_class``) in place (parameters, buffers
    and state-dict keys unchanged); returns how many were switched."""
    count = 0
    for m in model.modules():
        if eligible(m):
            m.__class__ = switched_class(switch, type(m))
            count += 1
    return count


def use_stream_convs(model: nn.Module) -> int:
    """Switch ``model``'s eligible convolutions to ``StreamConv2d``; returns how many were switched."""
    return switch_convs(model, stream_eligible, StreamConv2d)


def apply_wgrad_stream(model: nn.Module, on: bool, cuda_graph: str, device: torch.device) -> int:
    """Switch ``model``'s plain convolutions to ``StreamConv2d`` as ``train.fast.wgrad_stream`` asks: when it is on,
    the model trains on CUDA and each step is one CUDA graph (``cuda_graph`` "step": the stream is forked and
    joined inside it; torch.compile's own graphs capture the backward pass alone, which could not join it);
    returns how many layers."""
    if not on or cuda_graph != "step" or device.type != "cuda":
        return 0
    return use_stream_convs(model)


def side_stream_wanted(on: bool, cuda_graph: str, compiled: bool, one_student_call: bool, model: nn.Module) -> bool:
    """Whether a step runs the weight gradients on the side stream: ``train.fast.wgrad_stream`` asks for it, each step
    is one CUDA graph, the student is compiled (its backward one graph whose buffers the trainer keeps from
    reuse, so autograd adds no gradients into them outside it) and called once a step (with several calls,
    autograd would sum each weight's gradients on the main stream before the join), and it has convolutions
    that launch there."""
    return (on and cuda_graph == "step" and compiled and one_student_call
            and any(isinstance(m, tuple(SWITCHED_CONVS)) for m in model.modules()))
