"""A shake-shake block's two inner batch norms and ReLUs as one function over the stacked first convolution's
output, with a backward pass of three Triton kernels of our own (``model_swaps.FastShakeShakeBlock``'s
``paired_inner_bn_relu``, on).

Why: with one batch norm and one ReLU per branch, Inductor's backward kernels read each ReLU's output for its mask
(2.8 GB a step in the WRN-26 shake-shake 96x2d, a sixth of the backward pass's Inductor bytes). Taking the mask
from the batch norm's input instead, which the same kernels read anyway, made Inductor either store the masked
gradient in float32 or recompute each channel's scale and shift for every element (docs/journal/2026-11-28.md). Here:

- ``_sums_kernel``: per segment and channel of both branches, partial sums of the masked gradient ``g`` and of
  ``g * xhat`` over a chunk of pixels, reading the stacked input ``y`` and the two branches' output gradients once;
- ``_coef_kernel``: adds the chunks' sums in a fixed order (deterministic, no atomics) and writes, per segment and
  channel, the three coefficients of ``dy = a * g + b * (y - mean) + c``, and the weight and bias gradients;
- ``_apply_kernel``: ``dy`` for both branches into one tensor of the stacked channels, the layout the stacked
  convolution's input gradient takes (no concatenation).

Each channel's scale, shift, mean and reciprocal standard deviation are computed once per program from the
forward's statistics, not per element. The forward pass is the unpaired one-pass batch norm's
(``segmented_bn.segment_forward``), once per branch.

    ha, hb, mean_a, var_a, mean_b, var_b = bn_relu_pair(y, weight_a, bias_a, weight_b, bias_b, segments=2, eps=1e-5)
    # ha = relu(bn_a(y[:, :C])), hb = relu(bn_b(y[:, C:])), each run of N / segments rows with its own statistics

Requirements of the kernels (else the PyTorch formula runs, as on the CPU): CUDA, or Triton's interpreter
(``TRITON_INTERPRET=1`` before this module is imported) with CPU tensors; a channels_last ``y`` (the output
gradients are copied to that layout where they are not in it) whose branch channel count is a multiple of 8.
Importing this module needs no GPU.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from trainables.models.segmented_bn import SegmentedBatchNorm2d, segment_affine, segment_backward, segment_forward

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_INT32_LIMIT = 2**31
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# launch settings: the fastest of benchmarks/bn_relu_pair_bench.py's sweep at the shake-shake 96x2d step's three shapes
# (NVIDIA H200, 2026-11-28; 1,024 programs was 1-7% slower)
CHUNK_PIXELS = 4096   # the most pixels one program of the sums kernel adds up
BLOCK_PIXELS = 128    # pixels a program loads at a time
NUM_WARPS = 4
MIN_PROGRAMS = 256    # the sums kernel's chunks shrink (to BLOCK_PIXELS at least) until it has this many programs
KERNEL_CALLS = 0      # calls that ran the kernels (not the PyTorch formula): for checks that the step took them


# Only builtins of triton.language here (tl.reduce with our own combine function, not tl.sum): the standard library's
# @jit functions are compiled or interpreted as chosen when triton was first imported (see trainables.fast.conv_rows).
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _affine(mean_p, var_p, w_p, b_p, seg, c, eps, C2: tl.constexpr):
    """Per channel ``c`` of segment ``seg``: (scale, shift, mean, rstd) of the normalisation, float32."""
    mean = tl.load(mean_p + seg * C2 + c)
    rstd = tl.rsqrt(tl.load(var_p + seg * C2 + c) + eps)
    scale = rstd * tl.load(w_p + c).to(tl.float32)
    return scale, tl.load(b_p + c).to(tl.float32) - mean * scale, mean, rstd


@triton.jit
def _grad_at(dha, dhb, p, c, CH: tl.constexpr, in_a):
    """The output gradient at pixels ``p`` and stacked channels ``c`` (all in one branch's half), float32."""
    if in_a:
        d = tl.load(dha + p[:, None] * CH + c[None, :])
    else:
        d = tl.load(dhb + p[:, None] * CH + (c - CH)[None, :])
    return d.to(tl.float32)


@triton.jit
def _sums_kernel(dha, dhb, y, mean_p, var_p, w_p, b_p, part, eps, PSEG, CHUNK,
                 C2: tl.constexpr, CH: tl.constexpr, BP: tl.constexpr, BC: tl.constexpr):
    # one program per (chunk of pixels, block of channels), the channel blocks of a chunk next to each other in launch
    # order: together they read whole rows of y
    chunk = tl.program_id(0) // (C2 // BC)
    cb = tl.program_id(0) % (C2 // BC)
    c = cb * BC + tl.arange(0, BC)
    start = chunk * CHUNK
    scale, shift, mean, rstd = _affine(mean_p, var_p, w_p, b_p, start // PSEG, c, eps, C2)
    in_a = cb * BC < CH
    s1 = tl.full([BP, BC], 0.0, tl.float32)
    s2 = tl.full([BP, BC], 0.0, tl.float32)
    for p0 in range(start, start + CHUNK, BP):
        p = p0 + tl.arange(0, BP)
        yv = tl.load(y + p[:, None] * C2 + c[None, :]).to(tl.float32)
        g = tl.where(yv * scale[None, :] + shift[None, :] > 0, _grad_at(dha, dhb, p, c, CH, in_a), 0.0)
        s1 += g
        s2 += g * ((yv - mean[None, :]) * rstd[None, :])
    tl.store(part + (chunk * 2) * C2 + c, tl.reduce(s1, 0, _add))
    tl.store(part + (chunk * 2 + 1) * C2 + c, tl.reduce(s2, 0, _add))


@triton.jit
def _coef_kernel(part, mean_p, var_p, w_p, b_p, coef, dw, db, eps, inv_m, S, CHUNKS,
                 C2: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    c = tl.program_id(0) * BC + tl.arange(0, BC)
    dw_acc = tl.full([BC], 0.0, tl.float32)
    db_acc = tl.full([BC], 0.0, tl.float32)
    for seg in range(0, S):
        # a segment's chunks BK at a time, as one tile each (a loop of single loads would wait on each in turn)
        t1 = tl.full([BK, BC], 0.0, tl.float32)
        t2 = tl.full([BK, BC], 0.0, tl.float32)
        for k0 in range(seg * CHUNKS, (seg + 1) * CHUNKS, BK):
            k = k0 + tl.arange(0, BK)
            there = (k < (seg + 1) * CHUNKS)[:, None]
            t1 += tl.load(part + (k * 2)[:, None] * C2 + c[None, :], mask=there, other=0.0)
            t2 += tl.load(part + (k * 2 + 1)[:, None] * C2 + c[None, :], mask=there, other=0.0)
        s1 = tl.reduce(t1, 0, _add)
        s2 = tl.reduce(t2, 0, _add)
        scale, shift, mean, rstd = _affine(mean_p, var_p, w_p, b_p, seg, c, eps, C2)
        # dx = scale * (g - s1 / M - xhat * s2 / M), xhat = (y - mean) * rstd: a * g + b * (y - mean) + k
        tl.store(coef + (seg * 3) * C2 + c, scale)
        tl.store(coef + (seg * 3 + 1) * C2 + c, -scale * rstd * s2 * inv_m)
        tl.store(coef + (seg * 3 + 2) * C2 + c, -scale * s1 * inv_m)
        dw_acc += s2
        db_acc += s1
    tl.store(dw + c, dw_acc)
    tl.store(db + c, db_acc)


@triton.jit
def _apply_kernel(dha, dhb, y, mean_p, var_p, w_p, b_p, coef, dy, eps, PSEG,
                  C2: tl.constexpr, CH: tl.constexpr, BP: tl.constexpr, BC: tl.constexpr):
    tile = tl.program_id(0) // (C2 // BC)   # as in _sums_kernel: a tile's channel blocks next to each other
    cb = tl.program_id(0) % (C2 // BC)
    p = tile * BP + tl.arange(0, BP)
    c = cb * BC + tl.arange(0, BC)
    seg = (tile * BP) // PSEG
    scale, shift, mean, rstd = _affine(mean_p, var_p, w_p, b_p, seg, c, eps, C2)
    a = tl.load(coef + (seg * 3) * C2 + c)
    b = tl.load(coef + (seg * 3 + 1) * C2 + c)
    k = tl.load(coef + (seg * 3 + 2) * C2 + c)
    yv = tl.load(y + p[:, None] * C2 + c[None, :]).to(tl.float32)
    g = tl.where(yv * scale[None, :] + shift[None, :] > 0,
                 _grad_at(dha, dhb, p, c, CH, cb * BC < CH), 0.0)
    out = a[None, :] * g + b[None, :] * (yv - mean[None, :]) + k[None, :]
    tl.store(dy + p[:, None] * C2 + c[None, :], out.to(dy.dtype.element_ty))


def _pow2_divisor(n: int, most: int) -> int:
    """The largest power of two that divides ``n``, at most ``most``."""
    d = 1
    while d < most and n % (2 * d) == 0:
        d *= 2
    return d


def launch_plan(n: int, c2: int, h: int, w: int, segments: int) -> tuple[int, int, int]:
    """(chunk, block, channel block): the pixels a sums program adds up (a power of two dividing a segment's, shrunk
    until the kernel has ``MIN_PROGRAMS`` programs, to ``BLOCK_PIXELS`` at least), the pixels a program loads at a
    time, and the channels of a program (a power of two, at most 32, dividing each branch's)."""
    pseg = (n // segments) * h * w
    bc = _pow2_divisor(c2 // 2, 32)
    chunk = _pow2_divisor(pseg, CHUNK_PIXELS)
    while chunk > BLOCK_PIXELS and n * h * w // chunk * (c2 // bc) < MIN_PROGRAMS:
        chunk //= 2
    return chunk, min(chunk, BLOCK_PIXELS), bc


def kernels_run(y: Tensor) -> bool:
    """Whether the backward pass runs our kernels for ``y`` (N, 2C, H, W): on CUDA or in the interpreter, float16,
    bfloat16 or float32, channels_last, C a multiple of 8, fewer than 2**31 elements."""
    return ((y.is_cuda or (INTERPRET and y.device.type == "cpu")) and y.dim() == 4 and y.dtype in _KERNEL_DTYPES
            and y.is_contiguous(memory_format=torch.channels_last) and y.shape[1] % 16 == 0
            and y.numel() < _INT32_LIMIT)


def _reference_backward(dha: Tensor, dhb: Tensor, y: Tensor, mean: Tensor, var: Tensor, weight: Tensor,
                        bias: Tensor, eps: float, segments: int) -> tuple[Tensor, Tensor, Tensor]:
    """The backward pass in PyTorch (float32 at least), the one-pass batch norm's own: (dy, dweight, dbias)."""
    dt = torch.promote_types(y.dtype, torch.float32)
    view = (segments, 1, -1, 1, 1)
    mean = mean.to(dt).view(view)
    rstd, scale, shift = segment_affine(mean, var.to(dt).view(view), weight, bias, eps)
    dx, dw, db = segment_backward(torch.cat([dha, dhb], dim=1).unflatten(0, (segments, -1)).to(dt),
                                  y.unflatten(0, (segments, -1)).to(dt), mean, rstd, scale, shift, relu=True)
    return dx.to(y.dtype).flatten(0, 1).contiguous(memory_format=torch.channels_last), dw, db


@torch.library.custom_op("cowtune::bn_relu_pair_backward", mutates_args=())
def bn_relu_pair_backward(dha: Tensor, dhb: Tensor, y: Tensor, mean: Tensor, var: Tensor, weight: Tensor,
                          bias: Tensor, eps: float, segments: int) -> tuple[Tensor, Tensor, Tensor]:
    """(dy, dweight, dbias) of ``bn_relu_pair`` for the two branches' output gradients ``dha`` and ``dhb`` (N, C, H, W);
    ``y`` (N, 2C, H, W) its input, ``mean`` and ``var`` (segments, 2C) the forward's statistics, ``weight`` and ``bias``
    (2C,) both batch norms'. dy in y's dtype and layout, the weight and bias gradients in float32 (float64 for a
    float64 ``y``)."""
    global KERNEL_CALLS
    n, c2, h, w = y.shape
    chunk, bp, bc = launch_plan(n, c2, h, w, segments)
    if not kernels_run(y) or chunk == 1:   # chunk 1 (an odd segment): the partial sums' offsets could pass int32
        return _reference_backward(dha, dhb, y, mean, var, weight, bias, eps, segments)
    KERNEL_CALLS += 1
    ch = c2 // 2
    dha, dhb = (d.contiguous(memory_format=torch.channels_last) for d in (dha, dhb))
    pseg = (n // segments) * h * w
    f32 = dict(dtype=torch.float32, device=y.device)
    mean, var = mean.to(torch.float32).contiguous(), var.to(torch.float32).contiguous()
    chunks = n * h * w // chunk
    part = torch.empty((chunks, 2, c2), **f32)
    coef = torch.empty((segments, 3, c2), **f32)
    dw, db = torch.empty(c2, **f32), torch.empty(c2, **f32)
    dy = torch.empty_like(y, memory_format=torch.channels_last)
    warps = {} if INTERPRET else {"num_warps": NUM_WARPS}
    _sums_kernel[(chunks * (c2 // bc),)](dha, dhb, y, mean, var, weight, bias, part, eps, pseg, chunk,
                                     C2=c2, CH=ch, BP=bp, BC=bc, **warps)
    per_segment = chunks // segments
    _coef_kernel[(c2 // bc,)](part, mean, var, weight, bias, coef, dw, db, eps, 1.0 / pseg, segments, per_segment,
                              C2=c2, BC=bc, BK=min(triton.next_power_of_2(per_segment), 64), **warps)
    _apply_kernel[(n * h * w // bp * (c2 // bc),)](dha, dhb, y, mean, var, weight, bias, coef, dy, eps, pseg,
                                               C2=c2, CH=ch, BP=bp, BC=bc, **warps)
    return dy, dw, db


@bn_relu_pair_backward.register_fake
def _(dha, dhb, y, mean, var, weight, bias, eps, segments):
    c2, dt = y.shape[1], torch.promote_types(y.dtype, torch.float32)
    return (torch.empty_like(y, memory_format=torch.channels_last), y.new_empty(c2, dtype=dt), y.new_empty(c2, dtype=dt))


class _BnReluPair(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weight_a, bias_a, weight_b, bias_b, segments, eps):
        # each half as the one-pass batch norm computes it (segment_forward), as the unpaired layers do, so Inductor
        # writes each output once. Measured on an H200 (2026-11-28): one expression over both halves, sliced, it
        # stored whole and then copied half by half (2.3 GB and 0.57 ms a step); each half as a 4-d expression over its
        # rows, the step was 6.6% slower and its gradients wrong (the op most likely got none for the outputs).
        ya, yb = y.split(y.shape[1] // 2, dim=1)   # as ShakeShakeBlock splits it for the unpaired layers
        ha, mean_a, var_a = segment_forward(ya, weight_a, bias_a, segments, eps, relu=True)[:3]
        hb, mean_b, var_b = segment_forward(yb, weight_b, bias_b, segments, eps, relu=True)[:3]
        stats = [t.view(segments, -1) for t in (mean_a, var_a, mean_b, var_b)]
        ctx.save_for_backward(y, torch.cat(stats[0::2], dim=1), torch.cat(stats[1::2], dim=1),
                              torch.cat([weight_a, weight_b]), torch.cat([bias_a, bias_b]))
        ctx.segments, ctx.eps, ctx.dtypes = segments, eps, (weight_a.dtype, bias_a.dtype)
        ctx.mark_non_differentiable(*stats)
        return ha, hb, *stats

    @staticmethod
    def backward(ctx, dha, dhb, *_dstats):
        y, mean, var, weight, bias = ctx.saved_tensors
        ch = y.shape[1] // 2
        shape = (y.shape[0], ch, *y.shape[2:])
        dha = dha if dha is not None else y.new_zeros(shape).contiguous(memory_format=torch.channels_last)
        dhb = dhb if dhb is not None else y.new_zeros(shape).contiguous(memory_format=torch.channels_last)
        dy, dw, db = torch.ops.cowtune.bn_relu_pair_backward(dha, dhb, y, mean, var, weight, bias, ctx.eps,
                                                             ctx.segments)
        dw, db = dw.to(ctx.dtypes[0]), db.to(ctx.dtypes[1])
        return dy, dw[:ch], db[:ch], dw[ch:], db[ch:], None, None


def bn_relu_pair(y: Tensor, weight_a: Tensor, bias_a: Tensor, weight_b: Tensor, bias_b: Tensor, segments: int,
                 eps: float):
    """(relu(bn_a(y[:, :C])), relu(bn_b(y[:, C:])), mean_a, var_a, mean_b, var_b): training-mode batch norms of
    ``segments`` equal runs of rows, each with its own statistics, over the two halves of ``y`` (N, 2C, H, W), with
    each half's ``weight`` and ``bias`` (C,); the means and biased variances (segments, C) for the running
    statistics. One backward pass for both (``cowtune::bn_relu_pair_backward``)."""
    return _BnReluPair.apply(y, weight_a, bias_a, weight_b, bias_b, segments, eps)


def bn_relu_pair_of(bn_a: SegmentedBatchNorm2d, bn_b: SegmentedBatchNorm2d,
                    y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``relu(bn_a(y[:, :C]))`` and ``relu(bn_b(y[:, C:]))`` as one function (``bn_relu_pair``), with
    each layer's running statistics as its own call would keep them; only where ``pairs_in_one_pass``."""
    s = len(bn_a.segments)
    ha, hb, mean_a, var_a, mean_b, var_b = bn_relu_pair(y, bn_a.weight, bn_a.bias, bn_b.weight, bn_b.bias, s,
                                                        bn_a.eps)
    n = y.numel() // (s * y.shape[1])
    bn_a._track(mean_a, var_a, n)
    bn_b._track(mean_b, var_b, n)
    return ha, hb
