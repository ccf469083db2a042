"""``conv_bias_relu``: the plain path's values, and the fused operator's promised output shape and layout (which
torch.compile plans buffers by) against what ``F.conv2d`` gives. The fused cuDNN call itself runs on a GPU only:
``benchmarks/gpu_checks.py`` covers it (the shake-shake teacher's losses)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from trainables.conv_bias_relu import conv_bias_relu

CASES = [((1, 1), (1, 1), torch.channels_last), ((2, 2), (0, 0), torch.channels_last),
         ((1, 1), (1, 1), torch.contiguous_format), ((2, 2), (0, 0), torch.contiguous_format)]


@pytest.mark.parametrize("stride, padding, fmt", CASES)
def test_values_match_relu_of_conv(stride, padding, fmt):
    x = torch.randn(3, 8, 11, 11).to(memory_format=fmt)
    w, b = torch.randn(16, 8, 3, 3), torch.randn(16)
    y = conv_bias_relu(x, w, b, stride, padding)
    ref = F.relu(F.conv2d(x, w, b, stride, padding))
    torch.testing.assert_close(y, ref)
    assert (y == 0).any() and (y > 0).any()


def test_weights_are_cast_to_the_input_dtype():
    x = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    y = conv_bias_relu(x, torch.randn(8, 4, 3, 3), torch.randn(8), (1, 1), (1, 1))
    assert y.dtype == torch.float64


@pytest.mark.parametrize("stride, padding, fmt", CASES)
def test_fused_operator_promises_conv2d_shape_and_layout(stride, padding, fmt):
    x = torch.randn(3, 8, 11, 11).to(memory_format=fmt)
    w, b = torch.randn(16, 8, 3, 3), torch.randn(16)
    ref = F.conv2d(x, w, b, stride, padding)
    with FakeTensorMode() as mode:
        y = torch.ops.cowtune.conv_bias_relu(mode.from_tensor(x), mode.from_tensor(w), mode.from_tensor(b),
                                             list(stride), list(padding))
    assert y.shape == ref.shape and y.stride() == ref.stride() and y.dtype == ref.dtype
