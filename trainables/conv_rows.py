"""Row-streaming 3x3 convolutions for channels_last tensors: each input row is read once.

Why: the implicit-GEMM kernels of ``conv_triton`` load a shifted input tile for each of the 9
taps, so every input element crosses L2 and shared memory 9 times; at WRN-28-2's first stage
(32 channels) that L2 traffic, not device memory, bounds them (about 55 us where the memory bound
is 20 us, H100). Plain Triton cannot stage a halo tile in shared memory and slice it nine ways,
but it does not need to: a program here owns a group of whole images (and a band of their rows)
and walks down the rows. Its GEMM tile is one row of each of its images (M = images x W pixels),
so the three horizontal taps are three loads of the same row shifted by one pixel (the same
cache lines: L1 hits), and the three vertical taps need no reload at all: the row just loaded
feeds three float32 accumulators, those of the output rows above, at and below it, which rotate
as the program moves down. Each input row is thus fetched from L2 once per program (plus one
halo row above and below the band).

    y = conv3x3_rows_fwd(x, wp)          # wp = conv_triton.pack_weight(w, x.dtype)
    dx = conv3x3_rows_fwd(dy, wp_dgrad)  # wp_dgrad = pack_weight(w, dy.dtype, for_dgrad=True)
    dw = conv3x3_rows_wgrad(dy, x)       # float32, (K, C, 3, 3) in channels_last memory format

The weight gradient walks the rows the same way: the input row loaded at each step meets the
output-gradient rows below, at and above it (the last two carried from earlier steps), nine
float32 [K, C] accumulators collect one program's share, and each program stores its partial sum
(no atomics: the result is deterministic); one torch reduction adds the partials.

Requirements (a clear ``ValueError`` otherwise, and ``supports`` says it beforehand): NHWC
(channels_last) activations, channel counts multiples of 16, W a power of two with
images_per_program x W a power of two >= 16, and H divisible by the row band.

Importing this module needs no GPU; with ``TRITON_INTERPRET=1`` set before the import the kernels
run on CPU tensors in Triton's interpreter (for tests).
"""
from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from trainables.conv_triton import _INT32_LIMIT, _check_activation, _pow2_divisor

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_LAST_KERNEL: dict[str, Any] = {}


# --------------------------------------------------------------------------------------------
# kernels (builtins of triton.language only, as in conv_triton: see its note on the interpreter)


@triton.jit
def _row_tile(ptr, base, i, col, img_ok, offs_c, dx: tl.constexpr,
              H: tl.constexpr, W: tl.constexpr, CH: tl.constexpr):
    """Row i of each of the program's images, shifted by dx pixels: [images*W, channels]; zero
    outside the image (rows outside 0..H-1, columns outside 0..W-1, images past N)."""
    c2 = col + dx
    ok = img_ok & (i >= 0) & (i < H) & (c2 >= 0) & (c2 < W)
    return tl.load(ptr + (base + i * W + dx)[:, None] * CH + offs_c[None, :], mask=ok[:, None],
                   other=0.0)


@triton.jit
def _fwd_rows_kernel(x_ptr, w_ptr, y_ptr, N,
                     H: tl.constexpr, W: tl.constexpr, C: tl.constexpr, K: tl.constexpr,
                     IMGS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """y[n, o, :, k] = sum over kernel rows r, columns s and channels c of
    x[n, o + r - 1, : + s - 1, c] * w[3r + s, c, k], for IMGS images, ROWS rows, BLOCK_N outputs."""
    pid = tl.program_id(0)
    NUM_NT: tl.constexpr = K // BLOCK_N
    SEGS: tl.constexpr = H // ROWS
    nt = pid % NUM_NT                 # output-channel tile fastest: its siblings share the rows in L2
    rest = pid // NUM_NT
    r0 = (rest % SEGS) * ROWS
    n0 = (rest // SEGS) * IMGS
    BM: tl.constexpr = IMGS * W
    p = tl.arange(0, BM)
    img = n0 + p // W
    col = p % W
    img_ok = img < N
    base = img * (H * W) + col        # pixel index of (img, row 0, col)
    offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc_hi = tl.full((BM, BLOCK_N), 0.0, tl.float32)    # output row i - 1 (kernel row 2)
    acc_mid = tl.full((BM, BLOCK_N), 0.0, tl.float32)   # output row i (kernel row 1)
    for t in range(ROWS + 2):
        i = r0 - 1 + t                                  # the input row of this step
        acc_lo = tl.full((BM, BLOCK_N), 0.0, tl.float32)  # output row i + 1 (kernel row 0)
        for ck in tl.static_range(C // BLOCK_K):
            cc = ck * BLOCK_K + offs_k
            wrow = w_ptr + cc[:, None] * K + offs_n[None, :]
            for s in tl.static_range(3):
                a = _row_tile(x_ptr, base, i, col, img_ok, cc, s - 1, H, W, C)
                acc_lo = tl.dot(a, tl.load(wrow + s * (C * K)), acc_lo)
                acc_mid = tl.dot(a, tl.load(wrow + (3 + s) * (C * K)), acc_mid)
                acc_hi = tl.dot(a, tl.load(wrow + (6 + s) * (C * K)), acc_hi)
        # Output row i - 1 has all three kernel rows now (from steps 2 on it is in the band).
        out = y_ptr + (base + (i - 1) * W)[:, None] * K + offs_n[None, :]
        tl.store(out, acc_hi.to(y_ptr.dtype.element_ty), mask=(img_ok & (t >= 2))[:, None])
        acc_hi = acc_mid
        acc_mid = acc_lo


@triton.jit
def _wgrad_rows_kernel(dy_ptr, x_ptr, part_ptr, N,
                       H: tl.constexpr, W: tl.constexpr, C: tl.constexpr, K: tl.constexpr,
                       IMGS: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
                       BLOCK_KO: tl.constexpr):
    """part[program, k, 3r + s, c] = this program's share of
    sum over n, o, col of dy[n, o, col, k] * x[n, o + r - 1, col + s - 1, c]."""
    pid = tl.program_id(0)
    NUM_CT: tl.constexpr = C // BLOCK_C
    NUM_KT: tl.constexpr = K // BLOCK_KO
    SEGS: tl.constexpr = H // ROWS
    ch = pid % (NUM_CT * NUM_KT)      # channel tile fastest: its siblings share the rows in L2
    rest = pid // (NUM_CT * NUM_KT)
    r0 = (rest % SEGS) * ROWS
    n0 = (rest // SEGS) * IMGS
    BM: tl.constexpr = IMGS * W
    p = tl.arange(0, BM)
    img = n0 + p // W
    col = p % W
    img_ok = img < N
    base = img * (H * W) + col
    offs_c = (ch % NUM_CT) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_k = (ch // NUM_CT) * BLOCK_KO + tl.arange(0, BLOCK_KO)
    zero_d = tl.full((BM, BLOCK_KO), 0.0, dy_ptr.dtype.element_ty)
    d_prev = zero_d                   # dy row i - 1 (within the band, else zero)
    d_cur = zero_d                    # dy row i
    a0 = tl.full((BLOCK_KO, BLOCK_C), 0.0, tl.float32)
    a1 = tl.full((BLOCK_KO, BLOCK_C), 0.0, tl.float32)
    a2 = tl.full((BLOCK_KO, BLOCK_C), 0.0, tl.float32)
    a3 = tl.full((BLOCK_KO, BLOCK_C), 0.0, tl.float32)
    a4 = tl.full((BLOCK_KO, BLOCK_C), 0.0, tl.float32)
    a5 = tl.full((BLOCK_KO, BLOCK_C), 0.0, tl.float32)
    a6 = tl.full((BLOCK_KO, BLOCK_C), 0.0, tl.float32)
    a7 = tl.full((BLOCK_KO, BLOCK_C), 0.0, tl.float32)
    a8 = tl.full((BLOCK_KO, BLOCK_C), 0.0, tl.float32)
    for t in range(ROWS + 2):
        i = r0 - 1 + t                # the input row of this step
        o = i + 1                     # the dy row it meets through kernel row 0
        d_ok = img_ok & (o >= r0) & (o < r0 + ROWS)
        d_next = tl.load(dy_ptr + (base + o * W)[:, None] * K + offs_k[None, :],
                         mask=d_ok[:, None], other=0.0)
        lo, mid, hi = tl.trans(d_next), tl.trans(d_cur), tl.trans(d_prev)
        xa = _row_tile(x_ptr, base, i, col, img_ok, offs_c, -1, H, W, C)
        a0 = tl.dot(lo, xa, a0)
        a3 = tl.dot(mid, xa, a3)
        a6 = tl.dot(hi, xa, a6)
        xb = _row_tile(x_ptr, base, i, col, img_ok, offs_c, 0, H, W, C)
        a1 = tl.dot(lo, xb, a1)
        a4 = tl.dot(mid, xb, a4)
        a7 = tl.dot(hi, xb, a7)
        xc = _row_tile(x_ptr, base, i, col, img_ok, offs_c, 1, H, W, C)
        a2 = tl.dot(lo, xc, a2)
        a5 = tl.dot(mid, xc, a5)
        a8 = tl.dot(hi, xc, a8)
        d_prev = d_cur
        d_cur = d_next
    # Partials (programs, K, 9, C): element (k, tap, c) at k * 9C + tap * C + c.
    out = part_ptr + rest * (K * 9 * C) + offs_k[:, None] * (9 * C) + offs_c[None, :]
    tl.store(out + 0 * C, a0)
    tl.store(out + 1 * C, a1)
    tl.store(out + 2 * C, a2)
    tl.store(out + 3 * C, a3)
    tl.store(out + 4 * C, a4)
    tl.store(out + 5 * C, a5)
    tl.store(out + 6 * C, a6)
    tl.store(out + 7 * C, a7)
    tl.store(out + 8 * C, a8)


# --------------------------------------------------------------------------------------------
# configurations

# A config: BM = images x W pixels per GEMM tile, SEGS = row bands per image (ROWS = H / SEGS).
DEFAULT_FWD = {"BM": 128, "SEGS": 1, "num_warps": 4, "num_stages": 2}
DEFAULT_WGRAD = {"BM": 128, "SEGS": 1, "num_warps": 4, "num_stages": 2}
_FWD_BLOCK_CAP = 64      # input-channel chunk per tl.dot and output-channel tile
_WGRAD_BLOCK_CAP = 32    # wgrad channel tiles: 9 [32, 32] float32 accumulators fit in registers


# The configuration the training step uses per convolution shape and op ("fprop", "dgrad",
# "wgrad"), keyed (op, C, K, H, W) by the layer's own C -> K; shapes not listed run
# conv_triton's tap kernels. Filled from benchmarks/conv_rows_bench.py's measurements.
CONFIGS: dict[tuple[str, int, int, int, int], dict[str, int]] = {}


def config_for(op: str, c: int, k: int, h: int, w: int) -> dict[str, int] | None:
    """The row kernels' configuration for ``op`` of a C -> K convolution on H x W, or None (taps)."""
    return CONFIGS.get((op, c, k, h, w))


def _resolve(config: dict | None, default: dict, h: int, w: int) -> tuple[int, int, dict]:
    """(images per program, rows per program, launch options) of a config; ValueError if it does
    not fit the shape."""
    cfg = dict(default if config is None else config)
    bm, segs = cfg.pop("BM", default["BM"]), cfg.pop("SEGS", default["SEGS"])
    launch = {key: cfg.pop(key) for key in ("num_warps", "num_stages") if key in cfg}
    if cfg:
        raise ValueError(f"unknown config keys {sorted(cfg)}; known: BM, SEGS, num_warps, num_stages")
    if w & (w - 1):
        raise ValueError(f"the row kernels need a power-of-two width W, got {w}")
    if bm < 16 or bm & (bm - 1) or bm % w:
        raise ValueError(f"config BM={bm} must be a power of two >= 16 and a multiple of W={w}")
    if segs < 1 or h % segs:
        raise ValueError(f"config SEGS={segs} must divide H={h}")
    return bm // w, h // segs, launch


def supports(x_shape: tuple[int, ...], k: int, config: dict | None = None) -> bool:
    """Whether the row kernels take an (N, C, H, W) activation with k output channels (and config)."""
    if len(x_shape) != 4:
        return False
    _, c, h, w = x_shape
    if c % 16 or k % 16:
        return False
    try:
        _resolve(config, DEFAULT_FWD, h, w)
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------------------------
# host side


def conv3x3_rows_fwd(x: torch.Tensor, wp: torch.Tensor, *, config: dict | None = None) -> torch.Tensor:
    """conv2d(x, w, stride 1, padding 1, no bias) with ``wp = pack_weight(w, x.dtype)`` ([9, C, K]);
    with ``pack_weight(w, dtype, for_dgrad=True)`` and dy for x this is the input gradient.
    x: (N, C, H, W) channels_last. Returns (N, K, H, W) channels_last in x's dtype."""
    _check_activation("x", x, "C")
    n, c, h, w = x.shape
    if wp.dim() != 3 or wp.shape[0] != 9 or wp.shape[1] != c or not wp.is_contiguous():
        raise ValueError(f"wp must be a contiguous packed weight of shape (9, {c}, K) "
                         f"(see conv_triton.pack_weight), got {tuple(wp.shape)}")
    if wp.dtype != x.dtype or wp.device != x.device:
        raise ValueError(f"wp must match x's dtype and device ({x.dtype}, {x.device}), "
                         f"got ({wp.dtype}, {wp.device})")
    k = wp.shape[2]
    if k % 16:
        raise ValueError(f"wp has {k} output channels; the kernels need a multiple of 16")
    imgs, rows, launch = _resolve(config, DEFAULT_FWD, h, w)
    y = torch.empty((n, k, h, w), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    if y.numel() >= _INT32_LIMIT:
        raise ValueError(f"the output would have {y.numel()} elements; int32 indexing allows fewer than 2**31")
    block_k = _pow2_divisor(c, _FWD_BLOCK_CAP)
    block_n = _pow2_divisor(k, _FWD_BLOCK_CAP)
    grid = (triton.cdiv(n, imgs) * (h // rows) * (k // block_n),)
    if INTERPRET:
        launch = {}
    _LAST_KERNEL["fwd"] = _fwd_rows_kernel[grid](
        x, wp, y, n, H=h, W=w, C=c, K=k, IMGS=imgs, ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k,
        **launch)
    return y


def conv3x3_rows_wgrad(dy: torch.Tensor, x: torch.Tensor, *, config: dict | None = None) -> torch.Tensor:
    """The weight gradient dw (K, C, 3, 3), float32, of y = conv2d(x, w, padding=1) given dy; both
    (N, ·, H, W) channels_last. dw is in channels_last memory format (K, 3, 3, C in memory).
    Deterministic: per-program partial sums, added by one reduction."""
    _check_activation("dy", dy, "K")
    _check_activation("x", x, "C")
    if dy.device != x.device or dy.dtype != x.dtype:
        raise ValueError(f"dy and x must share device and dtype, got ({dy.device}, {dy.dtype}) "
                         f"and ({x.device}, {x.dtype})")
    n, c, h, w = x.shape
    if (dy.shape[0], dy.shape[2], dy.shape[3]) != (n, h, w):
        raise ValueError(f"dy {tuple(dy.shape)} and x {tuple(x.shape)} must share N, H and W "
                         f"(stride 1, padding 1)")
    k = dy.shape[1]
    imgs, rows, launch = _resolve(config, DEFAULT_WGRAD, h, w)
    block_c = _pow2_divisor(c, _WGRAD_BLOCK_CAP)
    block_ko = _pow2_divisor(k, _WGRAD_BLOCK_CAP)
    programs = triton.cdiv(n, imgs) * (h // rows)
    part = torch.empty((programs, k, 9, c), dtype=torch.float32, device=x.device)
    grid = (programs * (c // block_c) * (k // block_ko),)
    if INTERPRET:
        launch = {}
    _LAST_KERNEL["wgrad"] = _wgrad_rows_kernel[grid](
        dy, x, part, n, H=h, W=w, C=c, K=k, IMGS=imgs, ROWS=rows, BLOCK_C=block_c,
        BLOCK_KO=block_ko, **launch)
    return part.sum(dim=0).view(k, 3, 3, c).permute(0, 3, 1, 2)
