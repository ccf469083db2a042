"""trainables.conv_triton against PyTorch's convolution, on CPU through Triton's interpreter.

Triton decides interpreter or compiler when ``@triton.jit`` runs, i.e. when conv_triton is
imported, so TRITON_INTERPRET=1 is set around that import (and restored afterwards, so no other
test module sees it). The interpreter's tl.dot is numpy's float32 matmul, so float32 results
agree with PyTorch to float32 rounding.
"""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed: the Triton convolutions cannot run")


def _import_interpreted():
    prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        if "trainables.conv_triton" in sys.modules:
            return importlib.reload(sys.modules["trainables.conv_triton"])
        return importlib.import_module("trainables.conv_triton")
    finally:
        if prev is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = prev


ct = _import_interpreted()

ATOL = RTOL = 1e-4


def _cl(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


def _inputs(n=2, c=16, k=32, h=6, w=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = _cl(torch.randn(n, c, h, w, generator=g))
    wt = torch.randn(k, c, 3, 3, generator=g) / (9 * c) ** 0.5
    dy = _cl(torch.randn(n, k, h, w, generator=g))
    scale = 1.0 + 0.5 * torch.randn(c, generator=g)
    shift = 0.5 * torch.randn(c, generator=g)
    return x, wt, dy, scale, shift


def _prologue(x, scale, shift):
    return torch.relu(x * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1))


def _backward(dy, a, wt, mask):
    return torch.ops.aten.convolution_backward(dy, a, wt, None, [1, 1], [1, 1], [1, 1], False,
                                               [0, 0], 1, mask)


def test_interpreter_is_on():
    assert ct.INTERPRET, "conv_triton was imported without TRITON_INTERPRET=1"


@pytest.mark.parametrize("shape", [dict(), dict(c=48, k=16, h=5, w=7, n=1)])
@pytest.mark.parametrize("prologue", [False, True])
def test_fwd_matches_conv2d(shape, prologue):
    x, wt, _, scale, shift = _inputs(**shape)
    a = _prologue(x, scale, shift) if prologue else x
    ref = F.conv2d(a, wt, padding=1)
    y = ct.conv3x3_fwd(x, wt, *((scale, shift) if prologue else ()))
    assert y.shape == ref.shape and y.dtype == x.dtype
    assert y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=RTOL)


def test_fwd_statistics_epilogue():
    x, wt, _, scale, shift = _inputs()
    y, s, ss = ct.conv3x3_fwd(x, wt, scale, shift, return_stats=True)
    ref = F.conv2d(_prologue(x, scale, shift), wt, padding=1)
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=RTOL)
    assert s.dtype == ss.dtype == torch.float32 and s.shape == ss.shape == (wt.shape[0],)
    torch.testing.assert_close(s, ref.sum(dim=(0, 2, 3)), atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(ss, (ref * ref).sum(dim=(0, 2, 3)), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("block_m", [16, 64])
def test_fwd_forced_tile_sizes(block_m):
    x, wt, _, scale, shift = _inputs(n=1, h=5, w=9)
    y = ct.conv3x3_fwd(x, wt, scale, shift, config={"BLOCK_M": block_m, "num_warps": 4})
    torch.testing.assert_close(y, F.conv2d(_prologue(x, scale, shift), wt, padding=1),
                               atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("shape", [dict(), dict(c=48, k=16, h=5, w=7, n=1)])
def test_dgrad_matches_convolution_backward(shape):
    x, wt, dy, _, _ = _inputs(**shape)
    ref, _, _ = _backward(dy, x, wt, [True, False, False])
    dx = ct.conv3x3_dgrad(dy, wt)
    assert dx.shape == x.shape and dx.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(dx, ref, atol=ATOL, rtol=RTOL)


def test_packed_weight_paths_match():
    x, wt, dy, _, _ = _inputs(c=32, k=16)
    torch.testing.assert_close(ct.conv3x3_fwd_packed(x, ct.pack_weight(wt, x.dtype)),
                               ct.conv3x3_fwd(x, wt))
    torch.testing.assert_close(ct.conv3x3_fwd_packed(dy, ct.pack_weight(wt, dy.dtype, for_dgrad=True)),
                               ct.conv3x3_dgrad(dy, wt))


@pytest.mark.parametrize("prologue", [False, True])
def test_wgrad_matches_autograd(prologue):
    x, wt, dy, scale, shift = _inputs()
    xr = x.clone().requires_grad_(False)
    wr = wt.clone().requires_grad_(True)
    a = _prologue(xr, scale, shift) if prologue else xr
    F.conv2d(a, wr, padding=1).backward(dy)
    dw = ct.conv3x3_wgrad(dy, x, *((scale, shift) if prologue else ()))
    assert dw.shape == wt.shape and dw.dtype == torch.float32
    torch.testing.assert_close(dw, wr.grad, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("taps", [1, 3, 9])
def test_wgrad_tap_groups_and_splits(taps):
    # Uneven rows (M = 35 over 16-row tiles) so the last tile is partial and chunks differ.
    x, wt, dy, scale, shift = _inputs(n=1, c=32, k=16, h=5, w=7)
    _, ref, _ = _backward(dy, _prologue(x, scale, shift), wt, [False, True, False])
    dw = ct.conv3x3_wgrad(dy, x, scale, shift, config={"BLOCK_M": 16, "TAPS": taps, "num_warps": 4})
    torch.testing.assert_close(dw, ref, atol=ATOL, rtol=RTOL)


def test_wgrad_two_pass_and_channel_tiles():
    # Partial sums per split stored then summed (ATOMIC False), and channel tiles smaller than
    # C and K (several channel-tile programs per chunk).
    x, wt, dy, scale, shift = _inputs(n=1, c=32, k=32, h=5, w=7)
    _, ref, _ = _backward(dy, _prologue(x, scale, shift), wt, [False, True, False])
    dw = ct.conv3x3_wgrad(dy, x, scale, shift, config={"BLOCK_M": 16, "TAPS": 3, "SPLIT": 3,
                                                       "ATOMIC": False, "BLOCK_C": 16, "BLOCK_KO": 16})
    torch.testing.assert_close(dw, ref, atol=ATOL, rtol=RTOL)


def test_fwd_channel_tiles():
    x, wt, _, scale, shift = _inputs(c=32, k=32)
    y, s, ss = ct.conv3x3_fwd(x, wt, scale, shift, return_stats=True,
                              config={"BLOCK_M": 16, "BLOCK_K": 16, "BLOCK_N": 16})
    ref = F.conv2d(_prologue(x, scale, shift), wt, padding=1)
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(s, ref.sum(dim=(0, 2, 3)), atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(ss, (ref * ref).sum(dim=(0, 2, 3)), atol=1e-3, rtol=1e-4)


def test_padding_is_applied_after_the_prologue():
    # relu(shift) > 0 everywhere: a prologue applied to the zero padding would change the border.
    x, wt, _, _, _ = _inputs()
    scale = torch.zeros(x.shape[1])
    shift = torch.ones(x.shape[1])
    y = ct.conv3x3_fwd(x, wt, scale, shift)
    torch.testing.assert_close(y, F.conv2d(torch.ones_like(x), wt, padding=1), atol=ATOL, rtol=RTOL)


def test_bad_inputs_raise_value_error():
    x, wt, dy, scale, shift = _inputs()
    with pytest.raises(ValueError, match="channels_last"):
        ct.conv3x3_fwd(x.contiguous(), wt)
    with pytest.raises(ValueError, match="3x3"):
        ct.conv3x3_fwd(x, torch.randn(32, 16, 5, 5))
    with pytest.raises(ValueError, match="multiple of 16"):
        ct.conv3x3_fwd(_cl(torch.randn(2, 8, 6, 6)), torch.randn(32, 8, 3, 3))
    with pytest.raises(ValueError, match="multiple of 16"):
        ct.conv3x3_fwd(x, torch.randn(24, 16, 3, 3))
    with pytest.raises(ValueError, match="scale and shift"):
        ct.conv3x3_fwd(x, wt, scale)
    with pytest.raises(ValueError, match="share N, H and W"):
        ct.conv3x3_wgrad(_cl(dy[:, :, :5]), x)
    with pytest.raises(ValueError, match="output channels but dy has 32"):
        ct.conv3x3_dgrad(dy, torch.randn(48, 16, 3, 3))
    with pytest.raises(ValueError, match="input channels but the activation has 16"):
        ct.conv3x3_fwd(x, torch.randn(32, 48, 3, 3))
