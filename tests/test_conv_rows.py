"""trainables.fast.conv_rows against PyTorch's convolution, on CPU through Triton's interpreter.

Triton decides interpreter or compiler when ``@triton.jit`` runs, i.e. when conv_rows is imported,
so it is imported with TRITON_INTERPRET=1 set around the import (conftest.import_for_triton: no other
test module sees it). The interpreter's tl.dot is numpy's float32 matmul, so float32 results agree with PyTorch
to float32 rounding.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import import_for_triton

pytest.importorskip("triton", reason="triton is not installed: the Triton convolutions cannot run")


cr = import_for_triton("trainables.fast.conv_rows", interpreted=True)
TOL = dict(rtol=1e-4, atol=1e-4)


def _cl(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


def _inputs(n, c, k, h, w, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = _cl(torch.randn(n, c, h, w, generator=g))
    wt = torch.randn(k, c, 3, 3, generator=g) / (9 * c) ** 0.5
    dy = _cl(torch.randn(n, k, h, w, generator=g))
    return x, wt, dy


def _reference_backward(dy, x, wt):
    dx, dw, _ = torch.ops.aten.convolution_backward(dy, x, wt, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                                    [True, True, False])
    return dx, dw


# (N, C, K, H, W, config): one image per tile and several; several row bands; output-channel tiles; a
# batch that does not fill the last tile; images narrower than a tile
CASES = [
    (3, 16, 32, 8, 8, {"BM": 16, "SEGS": 2}),
    (2, 32, 16, 4, 16, {"BM": 32, "SEGS": 1}),
    (5, 64, 32, 8, 4, {"BM": 16, "SEGS": 4, "BN": 16}),
    (3, 16, 16, 6, 8, {"BM": 32, "SEGS": 3, "BN": 16}),
    (2, 4, 48, 2, 2, {"BM": 16, "SEGS": 1, "BN": 16}),
    (3, 3, 16, 8, 8, {"BM": 16, "SEGS": 2}),   # an image's channels (the stem) in a 4-channel tile
    (2, 1, 32, 4, 8, {"BM": 16, "SEGS": 1, "BN": 16}),
]


@pytest.mark.parametrize("n,c,k,h,w,config", CASES)
def test_forward_input_and_weight_gradients_match_pytorch(n, c, k, h, w, config):
    x, wt, dy = _inputs(n, c, k, h, w)
    y = cr.conv3x3_rows_fwd(x, wt, config=config)
    assert y.shape == (n, k, h, w) and y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y, F.conv2d(x, wt, padding=1), **TOL)
    ex, ew = _reference_backward(dy, x, wt)
    if cr.supports(dy.shape, c):   # the input gradient: the forward kernel on dy (K channels in, C out)
        dx = cr.conv3x3_rows_dgrad(dy, wt, config=config)
        torch.testing.assert_close(dx, ex, **TOL)
    dw = cr.conv3x3_rows_wgrad(dy, x, config=config)
    assert dw.dtype == torch.float32 and dw.shape == (k, c, 3, 3)
    assert dw.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(dw, ew, **TOL)


@pytest.mark.parametrize("segments", [1, 2])
def test_batch_norm_relu_prologue_per_segment(segments):
    """conv(relu(x * scale + shift)) with each segment of the batch its own scale and shift (the stacked
    student call's batches), forward and weight gradient; padding stays zero after the prologue."""
    n, c, k, h, w = 4, 16, 32, 8, 8
    x, wt, dy = _inputs(n, c, k, h, w, seed=5)
    g = torch.Generator().manual_seed(6)
    scale = 1.0 + 0.5 * torch.randn(segments, c, generator=g)
    shift = 0.5 * torch.randn(segments, c, generator=g) + 0.3   # relu(shift) > 0: a padded tap would show
    per_image = n // segments
    a = torch.relu(x * scale.repeat_interleave(per_image, 0)[:, :, None, None]
                   + shift.repeat_interleave(per_image, 0)[:, :, None, None])
    args = (scale, shift) if segments > 1 else (scale[0], shift[0])
    cfg = {"BM": 16, "SEGS": 2}
    y = cr.conv3x3_rows_fwd(x, wt, *args, config=cfg)
    torch.testing.assert_close(y, F.conv2d(a, wt, padding=1), **TOL)
    dw = cr.conv3x3_rows_wgrad(dy, x, *args, config=cfg)
    torch.testing.assert_close(dw, _reference_backward(dy, a, wt)[1], **TOL)


def test_default_configs_and_the_table_configs_run():
    x, wt, dy = _inputs(2, 32, 32, 8, 8)
    torch.testing.assert_close(cr.conv3x3_rows_fwd(x, wt), F.conv2d(x, wt, padding=1), **TOL)
    torch.testing.assert_close(cr.conv3x3_rows_wgrad(dy, x), _reference_backward(dy, x, wt)[1], **TOL)
    for (op, n, c, k, h, w), cfg in cr.CONFIGS.items():   # every table entry fits its own shape
        c_in, c_out = (k, c) if op == "dgrad" else (c, k)   # the input gradient runs K -> C
        assert cr.supports((n or 2, c_in, h, w), c_out, cfg), (op, c, k, h, w, cfg)


def test_weight_gradient_is_deterministic():
    x, _, dy = _inputs(4, 16, 16, 8, 8, seed=3)
    a = cr.conv3x3_rows_wgrad(dy, x, config={"BM": 16, "SEGS": 2})
    b = cr.conv3x3_rows_wgrad(dy, x, config={"BM": 16, "SEGS": 2})
    assert torch.equal(a, b)


@pytest.mark.parametrize("rows,cols,max_rows", [(5, 27, 512), (300, 70, 64), (64, 300, 16)])
def test_partial_sums_add_up(rows, cols, max_rows):
    """The weight gradient's partial sums, added by our own kernel: all rows at once, or in several loads."""
    part = torch.randn(rows, cols, 2, generator=torch.Generator().manual_seed(rows))
    out = cr._sum_partials(part, tile=256, max_rows=max_rows)
    assert out.shape == (cols, 2)
    torch.testing.assert_close(out, part.sum(dim=0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed"])
def test_weight_read_in_its_own_layout_and_dtype(layout):
    """The kernels read the (K, C, 3, 3) weight through its strides and cast it as they load: a model's
    float32 channels_last parameter, a plain one, and a non-contiguous view all give the same result."""
    x, wt, dy = _inputs(2, 16, 32, 8, 8, seed=7)
    w = {"contiguous": wt, "channels_last": _cl(wt),
         "transposed": wt.transpose(0, 1).contiguous().transpose(0, 1)}[layout]
    cfg = {"BM": 16, "SEGS": 2}
    torch.testing.assert_close(cr.conv3x3_rows_fwd(x, w, config=cfg), F.conv2d(x, wt, padding=1), **TOL)
    dx = cr.conv3x3_rows_dgrad(dy, w, config=cfg)
    torch.testing.assert_close(dx, _reference_backward(dy, x, wt)[0], **TOL)
    half = cr.conv3x3_rows_fwd(x.half(), w, config=cfg)   # the weight is cast to the input's dtype
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), F.conv2d(x.half().float(), wt.half().float(), padding=1),
                               rtol=1e-2, atol=1e-2)


def test_table_lookup_prefers_the_batch_then_any_batch(monkeypatch):
    monkeypatch.setattr(cr, "CONFIGS", {("fprop", 0, 32, 32, 32, 32): {"BM": 64},
                                        ("fprop", 256, 32, 32, 32, 32): {"BM": 128}})
    assert cr.tuned_config("fprop", 256, 32, 32, 32, 32) == {"BM": 128}
    assert cr.tuned_config("fprop", 512, 32, 32, 32, 32) == {"BM": 64}
    assert cr.tuned_config("wgrad", 512, 32, 32, 32, 32) is None
    assert cr.tuned_config("fprop", 512, 64, 64, 16, 16) is None


@pytest.mark.parametrize("call,match", [
    (lambda x, wt, dy: cr.conv3x3_rows_fwd(x.contiguous(), wt), "channels_last"),
    (lambda x, wt, dy: cr.conv3x3_rows_fwd(x.to(torch.float64), wt), "dtype torch.float64"),
    (lambda x, wt, dy: cr.conv3x3_rows_fwd(x, wt[:, :8]), "w has 8 input channels but x has 16"),
    (lambda x, wt, dy: cr.conv3x3_rows_fwd(x, wt.double()), "w has dtype torch.float64"),
    (lambda x, wt, dy: cr.conv3x3_rows_dgrad(dy, wt[:16]), "w has 16 output channels but dy has 32"),
    (lambda x, wt, dy: cr.conv3x3_rows_fwd(x, wt, config={"BM": 8}), "BM=8 must be a power of two >= 16"),
    (lambda x, wt, dy: cr.conv3x3_rows_fwd(x, wt, config={"BM": 16, "SEGS": 3}), "SEGS=3 must divide H=8"),
    (lambda x, wt, dy: cr.conv3x3_rows_fwd(x, wt, config={"BM": 16, "BN": 48}), "BN=48"),
    (lambda x, wt, dy: cr.conv3x3_rows_fwd(x, wt, config={"BM": 16, "TAPS": 3}), "unknown config keys"),
    (lambda x, wt, dy: cr.conv3x3_rows_wgrad(_cl(dy[:, :, :4]), x), "must share N, H and W"),
    (lambda x, wt, dy: cr.conv3x3_rows_wgrad(dy.half(), x), "share device and dtype"),
    (lambda x, wt, dy: cr.conv3x3_rows_fwd(_cl(torch.randn(1, 24, 8, 8)), torch.randn(32, 24, 3, 3)),
     "power-of-two number of input channels"),
    (lambda x, wt, dy: cr.conv3x3_rows_fwd(_cl(torch.randn(2, 3, 8, 8)), torch.randn(32, 3, 3, 3), torch.ones(3),
                                           torch.ones(3)), "prologue needs a power-of-two number of channels"),
    (lambda x, wt, dy: cr.conv3x3_rows_dgrad(dy, torch.randn(32, 3, 3, 3)), "no input gradient for a convolution of 3"),
    (lambda x, wt, dy: cr.conv3x3_rows_fwd(_cl(torch.randn(1, 16, 6, 6)), torch.randn(32, 16, 3, 3)),
     "power-of-two width"),
    (lambda x, wt, dy: cr.conv3x3_rows_fwd(x, torch.randn(32, 16, 1, 1)), "only 3x3 kernels"),
    (lambda x, wt, dy: cr.conv3x3_rows_fwd(x, wt, torch.ones(16)), "scale and shift go together"),
    (lambda x, wt, dy: cr.conv3x3_rows_fwd(x, wt, torch.ones(8), torch.ones(8)), r"\(C,\) or \(S, C\) with C = 16"),
    (lambda x, wt, dy: cr.conv3x3_rows_wgrad(dy, x, torch.ones(2, 16), torch.ones(2, 16), config={"BM": 16}),
     "segments of the 2 images must each hold a whole number"),
])
def test_bad_input_gets_one_clear_message(call, match):
    x, wt, dy = _inputs(2, 16, 32, 8, 8)
    with pytest.raises(ValueError, match=match):
        call(x, wt, dy)


def test_supports_says_beforehand():
    assert cr.supports((8, 32, 32, 32), 32)
    assert not cr.supports((8, 24, 32, 32), 32)        # C not a power of two
    assert cr.supports((8, 3, 32, 32), 16)             # an image's channels
    assert not cr.supports((8, 32, 32, 32), 24)        # K not a multiple of 16
    assert not cr.supports((8, 32, 30, 30), 32)        # W not a power of two
    assert not cr.supports((8, 32, 32, 32), 32, {"BM": 16})   # a tile narrower than an image row
    assert not cr.supports((8, 32, 32), 32)
