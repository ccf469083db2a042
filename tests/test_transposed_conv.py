"""The forward of a convolution computed as a transposed convolution (trainables/transposed_conv.py)."""
import pytest
import torch
import torch.nn.functional as F

from trainables import transposed_conv
from trainables.transposed_conv import TransposedForward, conv2d_as_transposed, shape_taken, taken
import trainables.wgrad_stream  # noqa: F401  (registers cowtune::conv2d)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("cin,cout,kernel", [(6, 10, 3), (5, 5, 3), (4, 7, 1), (3, 2, 5)])
def test_same_sums_as_conv2d(memory_format, cin, cout, kernel):
    g = torch.Generator().manual_seed(cin * cout + kernel)
    x = torch.randn(2, cin, 7, 9, dtype=torch.float64, generator=g).contiguous(memory_format=memory_format)
    w = torch.randn(cout, cin, kernel, kernel, dtype=torch.float64, generator=g)
    pad = [kernel // 2] * 2
    y = conv2d_as_transposed(x, w, pad, memory_format)
    torch.testing.assert_close(y, F.conv2d(x, w, padding=pad), rtol=1e-12, atol=1e-12)
    assert y.shape == (2, cout, 7, 9)


def test_refuses_padding_that_is_not_same():
    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    with pytest.raises(ValueError, match="'same' padding"):
        conv2d_as_transposed(x, w, [0, 0], torch.contiguous_format)


def test_taken_only_on_a_gpu_with_the_switch_on(monkeypatch):
    x, w = torch.randn(2, 96, 32, 32), torch.randn(96, 96, 3, 3)
    assert shape_taken(tuple(x.shape), tuple(w.shape), [1, 1], [1, 1])
    monkeypatch.setattr(TransposedForward, "on", True)
    assert not taken(x, w, [1, 1], [1, 1])            # a CPU tensor: the measured form is cuDNN's
    monkeypatch.setattr(TransposedForward, "on", False)
    assert not taken(x, w, [1, 1], [1, 1])


def test_shape_taken_only_for_the_listed_3x3_stride_1_convolutions(monkeypatch):
    monkeypatch.setattr(transposed_conv, "SHAPES", frozenset({(96, 192, 32, 32)}))   # in and out channels differ
    assert shape_taken((8, 96, 32, 32), (192, 96, 3, 3), [1, 1], [1, 1])
    assert not shape_taken((8, 192, 32, 32), (96, 192, 3, 3), [1, 1], [1, 1])   # in and out swapped
    assert not shape_taken((8, 96, 16, 16), (192, 96, 3, 3), [1, 1], [1, 1])    # another image size
    assert not shape_taken((8, 96, 32, 32), (192, 96, 3, 3), [2, 2], [1, 1])    # stride 2
    assert not shape_taken((8, 96, 32, 32), (192, 96, 3, 3), [1, 1], [0, 0])    # no padding
    assert not shape_taken((8, 96, 32, 32), (192, 96, 1, 1), [1, 1], [1, 1])    # 1x1
    monkeypatch.undo()
    assert not shape_taken((8, 384, 8, 8), (384, 384, 3, 3), [1, 1], [1, 1])    # measured, no gain: not listed


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_operator_taking_the_transposed_form_gives_conv2d(memory_format, monkeypatch):
    """``cowtune::conv2d`` where it takes the transposed form (made to here on CPU, where ``taken`` says no): the
    form runs, and the values, output layout and gradients (its backward unchanged) are F.conv2d's."""
    ran = []
    as_transposed = transposed_conv.conv2d_as_transposed
    monkeypatch.setattr(transposed_conv, "taken", lambda *args: True)
    monkeypatch.setattr(transposed_conv, "conv2d_as_transposed", lambda *a: ran.append(1) or as_transposed(*a))
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 4, 6, 6, dtype=torch.float64, generator=g).contiguous(memory_format=memory_format)
    w0 = torch.randn(5, 4, 3, 3, dtype=torch.float64, generator=g)
    dy = torch.randn(2, 5, 6, 6, dtype=torch.float64, generator=g)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    y = torch.ops.cowtune.conv2d(x, w, w, [1, 1], [1, 1])
    y.backward(dy)
    assert ran == [1]
    ref_x, ref_w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = F.conv2d(ref_x, ref_w, padding=1)
    ref.backward(dy)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    assert y.is_contiguous(memory_format=memory_format)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.grad, ref_w.grad, rtol=1e-12, atol=1e-12)
