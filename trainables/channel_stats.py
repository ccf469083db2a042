"""Per-segment, per-channel batch statistics of a channels_last tensor, in Triton.

Why: the one-pass segmented batch norm (``segmented_bn._EqualSegmentsBatchNorm``) needs, for each of
``s`` equal runs of images and each channel, the mean and biased variance over the run's pixels.
``torch.var_mean`` under Inductor lowers to a split Welford reduction: a long kernel of partial
Welford triples, then two more small kernels that reduce them. The kernels here read the tensor
once as the rows of a (pixels, C) matrix (NHWC memory) and keep float32 sums per lane, then one
small kernel adds the partial sums in a fixed order (deterministic, no atomics):

    mean, var = segment_stats(x, s)     # x (N, C, H, W) channels_last; mean, var (s, C) float32

Numerics: the sums are of ``x - shift``, where the shift is each segment's first pixel's value of
the channel, so ``E[d^2] - E[d]^2`` cancels little when the mean is large against the spread
(shifted sums, as Welford's algorithm would be without its division per element). Sums are float32.

Requirements (``supports`` says beforehand; a ``ValueError`` otherwise): a 4-d channels_last
tensor of float16, bfloat16 or float32 on a CUDA device (or on the CPU in Triton's interpreter,
``TRITON_INTERPRET=1`` before import), N divisible by s, fewer than 2**31 elements.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INT32_LIMIT = 2**31


@triton.jit
def _partial_sums(x_ptr, part_ptr, seg_rows, n_chunks, chunk_rows, C,
                  BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, STAGES: tl.constexpr):
    """Program (seg, chunk, cblock): shifted sums of a chunk of a segment's rows over BLOCK_C channels,
    stored at part[seg, chunk, 0 | 1, channels]."""
    seg = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    base = seg * seg_rows
    shift = tl.load(x_ptr + base * C + cols, mask=cmask, other=0.0).to(tl.float32)
    s1 = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    s2 = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    first = chunk * chunk_rows
    for r in tl.range(0, chunk_rows, BLOCK_M, num_stages=STAGES):
        rows = first + r + tl.arange(0, BLOCK_M)
        mask = (rows < seg_rows)[:, None] & cmask[None, :]
        v = tl.load(x_ptr + (base + rows)[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, v - shift[None, :], 0.0)
        s1 += d
        s2 += d * d
    out = part_ptr + ((seg * n_chunks + chunk) * 2) * C + cols
    tl.store(out, tl.sum(s1, axis=0), mask=cmask)
    tl.store(out + C, tl.sum(s2, axis=0), mask=cmask)


@triton.jit
def _finish(x_ptr, part_ptr, mean_ptr, var_ptr, seg_rows, n_chunks, C,
            BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (seg, cblock): adds the segment's chunk sums in order; stores mean and biased variance."""
    seg = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    s1 = tl.zeros([BLOCK_K, BLOCK_C], dtype=tl.float32)
    s2 = tl.zeros([BLOCK_K, BLOCK_C], dtype=tl.float32)
    for k0 in range(0, n_chunks, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask = (ks < n_chunks)[:, None] & cmask[None, :]
        at = part_ptr + ((seg * n_chunks + ks)[:, None] * 2) * C + cols[None, :]
        s1 += tl.load(at, mask=mask, other=0.0)
        s2 += tl.load(at + C, mask=mask, other=0.0)
    m1 = tl.sum(s1, axis=0) / seg_rows
    m2 = tl.sum(s2, axis=0) / seg_rows
    shift = tl.load(x_ptr + seg * seg_rows * C + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(mean_ptr + seg * C + cols, shift + m1, mask=cmask)
    tl.store(var_ptr + seg * C + cols, tl.maximum(m2 - m1 * m1, 0.0), mask=cmask)


def supports(x: torch.Tensor, s: int) -> str | None:
    """Why ``segment_stats(x, s)`` cannot run, or None when it can."""
    if x.dim() != 4:
        return f"a 4-d (N, C, H, W) tensor is needed, got {x.dim()}-d"
    if x.dtype not in _SUPPORTED_DTYPES:
        return f"dtype {x.dtype} is not one of {_SUPPORTED_DTYPES}"
    if not x.is_contiguous(memory_format=torch.channels_last):
        return "the tensor is not channels_last"
    if x.device.type != "cuda" and not INTERPRET:
        return (f"a tensor on {x.device.type} (the kernels run on CUDA devices, or on the CPU only in Triton's "
                f"interpreter: TRITON_INTERPRET=1 before importing this module)")
    if s < 1 or x.shape[0] % s:
        return f"{x.shape[0]} images do not split into {s} equal segments"
    if x.numel() >= _INT32_LIMIT:
        return f"{x.numel()} elements, the kernels index with int32 (under {_INT32_LIMIT})"
    return None


def default_config(seg_rows: int, c: int, s: int) -> dict[str, int]:
    """Tile and split for a segment of ``seg_rows`` pixels and ``c`` channels."""
    block_c = min(triton.next_power_of_2(c), 128)
    block_m = max(2048 // block_c, 1)
    cblocks = triton.cdiv(c, block_c)
    # about 4 programs per SM of a 132-SM GPU, each at least 8 tiles long
    chunks = max(1, min(528 // (s * cblocks), triton.cdiv(seg_rows, 8 * block_m)))
    return {"BLOCK_M": block_m, "BLOCK_C": block_c, "chunks": chunks, "num_warps": 4, "STAGES": 1}


def segment_stats(x: torch.Tensor, s: int, config: dict[str, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, biased variance), each (s, C) float32, of each of ``s`` equal runs of images of ``x``."""
    why = supports(x, s)
    if why:
        raise ValueError(f"segment_stats: {why}")
    n, c, h, w = x.shape
    seg_rows = n // s * h * w
    cfg = dict(default_config(seg_rows, c, s), **(config or {}))
    block_m, block_c = cfg["BLOCK_M"], cfg["BLOCK_C"]
    chunk_rows = triton.cdiv(triton.cdiv(seg_rows, cfg["chunks"]), block_m) * block_m
    chunks = triton.cdiv(seg_rows, chunk_rows)
    cblocks = triton.cdiv(c, block_c)
    part = torch.empty(s, chunks, 2, c, device=x.device, dtype=torch.float32)
    mean = torch.empty(s, c, device=x.device, dtype=torch.float32)
    var = torch.empty_like(mean)
    launch = {} if INTERPRET else {"num_warps": cfg["num_warps"]}
    _partial_sums[(s, chunks, cblocks)](x, part, seg_rows, chunks, chunk_rows, c,
                                        BLOCK_M=block_m, BLOCK_C=block_c, STAGES=cfg["STAGES"], **launch)
    block_k = min(triton.next_power_of_2(chunks), max(2048 // block_c, 1))
    _finish[(s, cblocks)](x, part, mean, var, seg_rows, chunks, c, BLOCK_K=block_k, BLOCK_C=block_c, **launch)
    return mean, var
