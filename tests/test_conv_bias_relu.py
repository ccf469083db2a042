"""``conv_bias_relu``: which path it takes, the fused operator's fallback and the output shape and layout it
promises (which torch.compile plans buffers by) against what ``F.conv2d`` gives. cuDNN's fused call itself runs on
a GPU only: the test marked for CUDA here, and ``benchmarks/gpu_checks.py folded_teacher``."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from trainables.fast.conv_bias_relu import conv_bias_relu, fused_wanted

CASES = [((1, 1), (1, 1), torch.channels_last), ((2, 2), (0, 0), torch.channels_last),
         ((1, 1), (1, 1), torch.contiguous_format), ((2, 2), (0, 0), torch.contiguous_format)]


def _inputs(fmt, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, 11, 11, generator=g).to(device, dtype).to(memory_format=fmt)
    return x, torch.randn(16, 8, 3, 3, generator=g).to(device, dtype), torch.randn(16, generator=g).to(device, dtype)


def test_fused_path_only_on_cuda_without_gradient():
    x, w, b = _inputs(torch.channels_last)
    assert not fused_wanted(x, w, b)   # a CPU tensor
    if torch.cuda.is_available():
        x, w, b = (t.cuda() for t in (x, w, b))
        with torch.no_grad():
            assert fused_wanted(x, w, b) == (torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled)
        assert not fused_wanted(x, w.requires_grad_(), b)


@pytest.mark.parametrize("stride, padding, fmt", CASES)
def test_operator_falls_back_where_cudnn_has_no_fused_form(stride, padding, fmt):
    """Called where cuDNN's fused form does not run (here: the CPU), the operator warns once per case and gives
    ``relu(conv2d)``'s values in the layout it promises."""
    x, w, b = _inputs(fmt)
    ref = F.relu(F.conv2d(x, w, b, stride, padding))
    with pytest.warns(UserWarning, match="no fused convolution"):
        y = torch.ops.cowtune.conv_bias_relu(x, w, b, list(stride), list(padding))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.ops.cowtune.conv_bias_relu(x, w, b, list(stride), list(padding))   # warned once already
    torch.testing.assert_close(y, ref)
    assert y.stride() == ref.stride() and (y == 0).any() and (y > 0).any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN's fused call needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stride, padding, fmt", CASES)
def test_fused_operator_on_cuda_matches_relu_of_conv(stride, padding, fmt, dtype):
    x, w, b = _inputs(fmt, "cuda", dtype)
    with torch.no_grad():
        y = torch.ops.cowtune.conv_bias_relu(x, w, b, list(stride), list(padding))
        ref = F.relu(F.conv2d(x, w, b, stride, padding))
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)
    assert y.stride() == ref.stride()


def test_weights_are_cast_to_the_input_dtype():
    x = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    y = conv_bias_relu(x, torch.randn(8, 4, 3, 3), torch.randn(8), (1, 1), (1, 1))
    assert y.dtype == torch.float64


@pytest.mark.parametrize("stride, padding, fmt", CASES)
def test_fused_operator_promises_conv2d_shape_and_layout(stride, padding, fmt):
    x, w, b = _inputs(fmt)
    ref = F.conv2d(x, w, b, stride, padding)
    with FakeTensorMode() as mode:
        y = torch.ops.cowtune.conv_bias_relu(mode.from_tensor(x), mode.from_tensor(w), mode.from_tensor(b),
                                             list(stride), list(padding))
    assert y.shape == ref.shape and y.stride() == ref.stride() and y.dtype == ref.dtype
