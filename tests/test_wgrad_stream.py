"""The ``cowtune::conv2d`` operator and the switch to it (``trainables.fast.wgrad_stream``), on CPU: its
registrations agree with the real kernels, switched models compute what the originals do, forward and
backward, eagerly, under autocast and under torch.compile. (The side stream itself needs a GPU:
``benchmarks/gpu_checks.py wgrad_stream`` checks that it changes no bit of the weights.)"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from trainables.fast.fast_conv import TritonConv2d, use_triton_convs
from trainables.models import create_model
from trainables.models.layers import SameConv2d
from trainables.fast.wgrad_stream import (StreamConv2d, apply_wgrad_stream, backward_on_side, on_side,
                                          side_stream_wanted, use_stream_convs)


@pytest.mark.parametrize("stride, padding, kernel, channels_last",
                         [(1, 1, 3, False), (2, 1, 3, True), (2, 0, 1, True), (1, 0, 1, False)])
def test_operator_registrations_agree(stride, padding, kernel, channels_last):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(2, 4, 6, 5, dtype=torch.float64).contiguous(memory_format=fmt).requires_grad_()
    w = torch.randn(3, 4, kernel, kernel, dtype=torch.float64).contiguous(memory_format=fmt).requires_grad_()
    args = (x, w, w, [stride, stride], [padding, padding])
    torch.library.opcheck(torch.ops.cowtune.conv2d.default, args)
    assert torch.autograd.gradcheck(lambda a, b: torch.ops.cowtune.conv2d(a, b, b, *args[3:]), (x, w))
    out = torch.ops.cowtune.conv2d(*args)
    torch.testing.assert_close(out, torch.nn.functional.conv2d(x, w, None, stride, padding), rtol=0, atol=0)


@pytest.mark.parametrize("x_last, w_last", [(False, False), (False, True), (True, False), (True, True)])
def test_output_and_input_gradient_keep_the_layouts_conv2d_gives(x_last, w_last):
    # a layout of its own would make the layers after it pick other kernels than the unswitched model's
    # (in float32 on a GPU: other TF32 results, which the step-graph check once caught)
    def fmt(last: bool):
        return torch.channels_last if last else torch.contiguous_format

    x = torch.randn(2, 4, 6, 6).contiguous(memory_format=fmt(x_last)).requires_grad_()
    w = torch.randn(8, 4, 3, 3).contiguous(memory_format=fmt(w_last)).requires_grad_()
    y = torch.ops.cowtune.conv2d(x, w, w, [1, 1], [1, 1])
    ref = torch.nn.functional.conv2d(x, w, None, 1, 1)
    assert y.stride() == ref.stride()
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    (ref_dx,) = torch.autograd.grad(ref, x, torch.ones_like(ref))
    assert dx.stride() == ref_dx.stride()


def test_no_input_gradient_when_the_input_needs_none():
    x = torch.randn(2, 3, 8, 8)
    conv = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
    ref = copy.deepcopy(conv)
    assert use_stream_convs(conv) == 1
    y = conv(x)
    y.square().sum().backward()
    ref(x).square().sum().backward()
    assert x.grad is None
    torch.testing.assert_close(conv.weight.grad, ref.weight.grad)


@pytest.mark.parametrize("name, count", [("wrn28_2", 5), ("wrn26_2_shakeshake", 6)])
def test_switched_model_computes_the_same_forward_and_backward(name, count):
    """WRN-28-2 after the row-kernel switch keeps 5 plain convolutions (1x1 shortcuts, stride 2); the shake-shake
    WRN-26 2x32d keeps its 6 stride-2 ones (the row kernels take the stem and every stride-1 convolution, at 32-128
    channels; a block's two first convolutions, if switched to the stream, would still run as one F.conv2d)."""
    torch.manual_seed(0)
    a = create_model(name, 10)
    b = copy.deepcopy(a)
    use_triton_convs(b)
    keys = list(b.state_dict())
    assert use_stream_convs(b) == count and list(b.state_dict()) == keys
    left = [m for m in b.modules() if isinstance(m, nn.Conv2d) and not isinstance(m, (StreamConv2d, TritonConv2d))]
    assert all(m.bias is not None for m in left)
    x = torch.randn(4, 3, 32, 32)
    torch.manual_seed(1)   # shake-shake's gates
    ya = a(x)
    torch.manual_seed(1)
    yb = b(x)
    torch.testing.assert_close(yb, ya, rtol=1e-5, atol=1e-5)
    ya.square().sum().backward()
    yb.square().sum().backward()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=n)


def test_switched_layers_under_autocast_and_compile_match():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(8, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                        SameConv2d(16, 8, 3, 2, bias=False))   # TF "same" padding: padded in its own forward
    ref = copy.deepcopy(net)
    assert use_stream_convs(net) == 2
    x = torch.randn(4, 8, 8, 8).contiguous(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yb, ya = net(x), ref(x)
    assert yb.dtype == ya.dtype == torch.bfloat16 and type(net[3]).__name__ == "StreamSameConv2d"
    torch.testing.assert_close(yb, ya, rtol=0, atol=0)
    out = torch.compile(net, dynamic=False)(x)
    expect = ref(x)
    torch.testing.assert_close(out, expect, rtol=1e-4, atol=1e-4)
    out.sum().backward()
    expect.sum().backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)


def test_the_switch_asks_for_cuda_and_a_step_graph():
    model = create_model("wrn28_2", 10)
    assert apply_wgrad_stream(model, True, "step", torch.device("cpu")) == 0
    assert apply_wgrad_stream(model, False, "step", torch.device("cuda")) == 0
    for graphs in ("model", "none"):
        assert apply_wgrad_stream(model, True, graphs, torch.device("cuda")) == 0
    assert not any(type(m) is StreamConv2d for m in model.modules())
    assert apply_wgrad_stream(model, True, "step", torch.device("cuda")) == 28   # a device, no tensor on it
    assert use_stream_convs(nn.Conv2d(4, 4, 3, bias=True)) == 0


def test_a_biased_stream_convolution_is_refused():
    conv = nn.Conv2d(4, 4, 3, bias=True)
    conv.__class__ = StreamConv2d
    with pytest.raises(ValueError, match="without bias"):
        conv(torch.randn(1, 4, 5, 5))


def test_nothing_goes_to_a_side_stream_off_the_gpu():
    from trainables.fast import wgrad_stream

    x = torch.ones(3)
    with backward_on_side(True, torch.device("cpu")):
        assert wgrad_stream._on and on_side(lambda: x * 2, x) is None
    assert not wgrad_stream._on and not wgrad_stream._HELD


def test_the_stream_only_for_one_compiled_student_call_a_step_graph():
    """With several student calls a step, autograd would sum a weight's gradients on the main stream before the
    join; eagerly, it could add into a gradient the side stream still reads."""
    model = create_model("wrn28_2", 10)
    assert not side_stream_wanted(True, "step", True, True, model)   # no convolution launches there
    use_stream_convs(model)
    assert side_stream_wanted(True, "step", True, True, model)
    for args in ((False, "step", True, True), (True, "model", True, True), (True, "none", True, True),
                 (True, "step", False, True), (True, "step", True, False)):
        assert not side_stream_wanted(*args, model), args
