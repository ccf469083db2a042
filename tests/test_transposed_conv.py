"""The forward of a convolution computed as a transposed convolution (trainables/transposed_conv.py)."""
import pytest
import torch
import torch.nn.functional as F

from trainables import transposed_conv
from trainables.transposed_conv import TransposedForward, conv2d_as_transposed, taken
from trainables.wgrad_stream import conv2d


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("cin,cout,kernel", [(6, 10, 3), (5, 5, 3), (4, 7, 1), (3, 2, 5)])
def test_same_sums_as_conv2d(memory_format, cin, cout, kernel):
    g = torch.Generator().manual_seed(cin * cout + kernel)
    x = torch.randn(2, cin, 7, 9, dtype=torch.float64, generator=g).contiguous(memory_format=memory_format)
    w = torch.randn(cout, cin, kernel, kernel, dtype=torch.float64, generator=g)
    pad = [kernel // 2] * 2
    y = conv2d_as_transposed(x, w, pad)
    torch.testing.assert_close(y, F.conv2d(x, w, padding=pad), rtol=1e-12, atol=1e-12)
    assert y.shape == (2, cout, 7, 9)


def test_refuses_padding_that_is_not_same():
    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    with pytest.raises(ValueError, match="'same' padding"):
        conv2d_as_transposed(x, w, [0, 0])


def test_taken_only_on_its_gpu_for_its_shapes(monkeypatch):
    x, w = torch.randn(2, 96, 32, 32), torch.randn(96, 96, 3, 3)
    monkeypatch.setattr(TransposedForward, "on", True)
    assert (96, 96, 32, 32) in transposed_conv.SHAPES
    assert not taken(x, w, [1, 1], [1, 1])            # a CPU tensor: the measured form is cuDNN's
    monkeypatch.setattr(TransposedForward, "on", False)
    assert not taken(x, w, [1, 1], [1, 1])


def test_operator_gives_conv2d_with_switch_on(monkeypatch):
    """On CPU the operator keeps the plain form whatever the switch says; its values and gradients are conv2d's."""
    monkeypatch.setattr(TransposedForward, "on", True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(4, 4, 3, 3, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.ops.cowtune.conv2d(x, w, w, [1, 1], [1, 1])
    torch.testing.assert_close(y, F.conv2d(x, w, padding=1), rtol=1e-12, atol=1e-12)
    assert conv2d is not None
