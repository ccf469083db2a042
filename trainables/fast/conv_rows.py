"""Row-streaming 3x3 convolutions for channels_last tensors, written in Triton.

Why: WRN-28-2's 3x3 convolutions are narrow (32-128 channels) and cuDNN runs them at 10-33% of
their memory bound on an H100. An implicit GEMM that loads a shifted input tile per tap moves every
input element through L2 and shared memory 9 times; at 32 channels that traffic, not device
memory, bounds it. The kernels here read each input row about once:

- A program owns a group of whole images (or a band of their rows) and walks down the rows. Its
  GEMM tile is one row of each of its images: M = images x W pixels.
- The three horizontal taps of a pixel are its left neighbour, itself and its right neighbour,
  whose channels lie next to each other in NHWC memory. So the A tile is [pixels, 4C]: column j
  holds channel j % C of the pixel j // C - 1 places to the right, one contiguous span per pixel
  (the fourth pixel meets zero rows of the weight operand; 4C keeps the tile a power of two). One
  product per kernel row replaces three per tap. The weight is read in its own layout and dtype by
  each program (no packing pass).
- The three vertical taps need no reload: the row just loaded feeds three float32 accumulators,
  those of the output rows below, at and above it, which rotate as the program moves down.

    y = conv3x3_rows_fwd(x, w)          # F.conv2d(x, w, padding=1)
    dx = conv3x3_rows_dgrad(dy, w)      # input gradient
    dw = conv3x3_rows_wgrad(dy, x)      # weight gradient, float32

The input gradient of a stride-1 pad-1 convolution is the same convolution of dy with the flipped,
channel-swapped weight. The weight gradient walks the rows the same way: each input row meets the
output-gradient rows below, at and above it (two carried from earlier steps) in three
[4C, pixels] x [pixels, K] products; each program stores its float32 partial sums and a second kernel
adds them in a fixed order, so the result is deterministic (no atomics).

Requirements (``supports`` says beforehand; a clear ``ValueError`` otherwise): NHWC
(channels_last) activations of float16, bfloat16 or float32; C a power of two >= 4, or 1-3 (an image's:
the tile holds 4, the rest zero); K a multiple of 16; W a power of two; a tile of BM pixels (a power of
two >= 16 and a multiple of W) and H divisible by the number of row bands. Measured (H100, bf16,
CUDA-graph replay, L2 flushed; benchmarks/conv_rows_bench.py --table-only; docs/journal/2026-11-27.md): at
N=512, 32 channels, 32x32, forward 43.1 us against cuDNN's 63.6, input gradient 42.4 (61.2), weight
gradient 68.8 (112.3); at 64 channels, 16x16, forward 34.4 (40.6) and input gradient 33.5 (35.0); the
16 -> 32 convolution at 32x32: forward 29.5 (69.8), input gradient 36.9 (63.5), weight gradient 54.9
(101.5).

Numerics: float32 accumulation; float32 inputs use ``tl.dot``'s default input precision (TF32 on
NVIDIA GPUs, exact in the interpreter). Indexing is int32: tensors of 2**31 elements or more are
refused. Importing this module needs no GPU; with ``TRITON_INTERPRET=1`` set before the import the
kernels run on CPU tensors in Triton's interpreter (for tests).
"""
from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INT32_LIMIT = 2**31
_LAST_KERNEL: dict[str, Any] = {}   # the last launched kernel per name ("fwd", "wgrad"), for reports


# --------------------------------------------------------------------------------------------
# kernels. They use only builtins of triton.language, none of its @jit-decorated standard library
# (tl.zeros, tl.cdiv, tl.sum): those are compiled or interpreted as chosen when triton itself was
# imported, so with them these kernels would fail in the interpreter whenever triton was imported
# (by torch.compile, say) before TRITON_INTERPRET was set.


@triton.jit
def _wide_ok(i, col, img_ok, j, H: tl.constexpr, W: tl.constexpr, CH: tl.constexpr, CM: tl.constexpr):
    c2 = col[:, None] + (j // CH - 1)[None, :]
    ok = img_ok[:, None] & (i >= 0) & (i < H) & (c2 >= 0) & (c2 < W) & (j < 3 * CH)[None, :]
    if CM < CH:   # an image's 1-3 channels in a 4-channel tile: the rest are zero
        ok = ok & (j % CH < CM)[None, :]
    return ok


@triton.jit
def _wide_at(base, i, j, W: tl.constexpr, CH: tl.constexpr, CM: tl.constexpr):
    """The [pixels, 4CH] offsets of row i's wide tile (see ``_wide_tile``) in an NHWC tensor of CM channels."""
    if CM == CH:   # one contiguous span of 4CH elements per pixel
        return (base + i * W - 1)[:, None] * CH + j[None, :]
    return (base + i * W - 1)[:, None] * CM + ((j // CH) * CM + j % CH)[None, :]


@triton.jit
def _prologue(a, ok, sc, sh, PROLOGUE: tl.constexpr):
    """relu(a * scale + shift) per channel, computed in float32 and rounded back, zero where ``ok`` is
    false (the zero padding applies after it); ``a`` unchanged without the prologue."""
    if PROLOGUE:
        af = tl.maximum(a.to(tl.float32) * sc + sh, 0.0)
        a = tl.where(ok, af, 0.0).to(a.dtype)
    return a


@triton.jit
def _wide_tile(ptr, base, i, col, img_ok, j, sc, sh, H: tl.constexpr, W: tl.constexpr, CH: tl.constexpr,
               CM: tl.constexpr, PROLOGUE: tl.constexpr):
    """Row i of each image as a [pixels, 4CH] tile: column j is channel j % CH of the pixel
    j // CH - 1 places to the right; zero outside the image, in the fourth pixel's columns and, when
    the tensor has CM < CH channels, in the columns of channels CM..CH-1.
    With the prologue, relu(x * sc + sh) (sc, sh: per column)."""
    ok = _wide_ok(i, col, img_ok, j, H, W, CH, CM)
    a = tl.load(ptr + _wide_at(base, i, j, W, CH, CM), mask=ok, other=0.0)
    return _prologue(a, ok, sc[None, :], sh[None, :], PROLOGUE)


@triton.jit
def _wide_tile_t(ptr, base, i, col, img_ok, j, sc, sh, H: tl.constexpr, W: tl.constexpr, CH: tl.constexpr,
                 CM: tl.constexpr, PROLOGUE: tl.constexpr):
    """The [4CH, pixels] transpose of ``_wide_tile``, loaded as such."""
    ok = tl.trans(_wide_ok(i, col, img_ok, j, H, W, CH, CM))
    a = tl.load(ptr + tl.trans(_wide_at(base, i, j, W, CH, CM)), mask=ok, other=0.0)
    return _prologue(a, ok, sc[:, None], sh[:, None], PROLOGUE)


@triton.jit
def _affine(scale_ptr, shift_ptr, n0, SEG, j, C: tl.constexpr, PROLOGUE: tl.constexpr):
    """The prologue's per-column scale and shift for the program's images (all in segment n0 // SEG)."""
    if PROLOGUE:
        at = (n0 // SEG) * C + j % C
        return tl.load(scale_ptr + at), tl.load(shift_ptr + at)
    return tl.full(j.shape, 0.0, tl.float32), tl.full(j.shape, 0.0, tl.float32)


@triton.jit
def _program_tile(N, H: tl.constexpr, W: tl.constexpr, C: tl.constexpr, K: tl.constexpr, IMGS: tl.constexpr,
                  ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """What this program owns: (its image group and band's index, first row, first image, each tile
    pixel's column, whether its image exists, its pixel index at row 0, the output channels, the wide
    tile's column indices). The output-channel tile varies fastest across programs, so the programs
    that share the same rows run together and find them in L2."""
    pid = tl.program_id(0)
    NUM_NT: tl.constexpr = K // BLOCK_N
    SEGS: tl.constexpr = H // ROWS
    rest = pid // NUM_NT
    r0 = (rest % SEGS) * ROWS
    n0 = (rest // SEGS) * IMGS
    p = tl.arange(0, IMGS * W)
    img = n0 + p // W
    col = p % W
    offs_n = (pid % NUM_NT) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rest, r0, n0, col, img < N, img * (H * W) + col, offs_n, tl.arange(0, 4 * C)


@triton.jit
def _conv_rows_fwd_kernel(x_ptr, w_ptr, y_ptr, scale_ptr, shift_ptr, N, SEG,
                          W_OFF, W_SR, W_SS, W_SC, W_SK,
                          H: tl.constexpr, W: tl.constexpr, C: tl.constexpr, K: tl.constexpr,
                          IMGS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                          PROLOGUE: tl.constexpr, CM: tl.constexpr):
    """y[n, o, :, k] = sum over kernel rows r of wide(x[n, o + r - 1]) @ B_r[:, k] for IMGS images, a band
    of ROWS output rows and BLOCK_N output channels. B_r[s * C + c, k] (s < 3, c < CM) is the weight element
    at w_ptr + W_OFF + r * W_SR + s * W_SS + c * W_SC + k * W_SK, read and cast here (the weight's
    own layout and dtype: no packing pass); rows 3C..4C-1, and those of channels CM..C-1, are zero. x has
    CM channels (C, or 1-3 in a tile of C = 4)."""
    BM: tl.constexpr = IMGS * W
    rest, r0, n0, col, img_ok, base, offs_n, j = _program_tile(N, H, W, C, K, IMGS, ROWS, BLOCK_N)
    sc, sh = _affine(scale_ptr, shift_ptr, n0, SEG, j, C, PROLOGUE)
    wr = w_ptr + W_OFF + ((j // C) * W_SS + (j % C) * W_SC)[:, None] + offs_n[None, :] * W_SK
    w_ok = ((j < 3 * C) & (j % C < CM))[:, None]
    dt = x_ptr.dtype.element_ty
    w_lo = tl.load(wr, mask=w_ok, other=0.0).to(dt)                # kernel row 0: feeds output row i + 1
    w_mid = tl.load(wr + W_SR, mask=w_ok, other=0.0).to(dt)        # kernel row 1: output row i
    w_hi = tl.load(wr + 2 * W_SR, mask=w_ok, other=0.0).to(dt)     # kernel row 2: output row i - 1
    acc_hi = tl.full((BM, BLOCK_N), 0.0, tl.float32)
    acc_mid = tl.full((BM, BLOCK_N), 0.0, tl.float32)
    for t in range(ROWS + 2):
        i = r0 - 1 + t                # the input row of this step
        a = _wide_tile(x_ptr, base, i, col, img_ok, j, sc, sh, H, W, C, CM, PROLOGUE)
        acc_lo = tl.dot(a, w_lo)
        acc_mid = tl.dot(a, w_mid, acc_mid)
        acc_hi = tl.dot(a, w_hi, acc_hi)
        # Output row i - 1 is complete (and in the band from step 2 on).
        out = y_ptr + (base + (i - 1) * W)[:, None] * K + offs_n[None, :]
        tl.store(out, acc_hi.to(y_ptr.dtype.element_ty), mask=(img_ok & (t >= 2))[:, None])
        acc_hi = acc_mid
        acc_mid = acc_lo


@triton.jit
def _conv_rows_wgrad_kernel(dy_ptr, x_ptr, part_ptr, scale_ptr, shift_ptr, N, SEG,
                            H: tl.constexpr, W: tl.constexpr, C: tl.constexpr, K: tl.constexpr,
                            IMGS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                            PROLOGUE: tl.constexpr, CM: tl.constexpr):
    """part[program, k, 3r + s, c]: this program's share of the weight gradient
    sum over n, o, col of dy[n, o, col, k] * x[n, o + r - 1, col + s - 1, c] (c < CM: x's channels)."""
    BM: tl.constexpr = IMGS * W
    JC: tl.constexpr = 4 * C
    rest, r0, n0, col, img_ok, base, offs_k, j = _program_tile(N, H, W, C, K, IMGS, ROWS, BLOCK_N)
    sc, sh = _affine(scale_ptr, shift_ptr, n0, SEG, j, C, PROLOGUE)
    d_prev = tl.full((BM, BLOCK_N), 0.0, dy_ptr.dtype.element_ty)   # dy row i - 1 (zero outside the band)
    d_cur = tl.full((BM, BLOCK_N), 0.0, dy_ptr.dtype.element_ty)    # dy row i
    g_lo = tl.full((JC, BLOCK_N), 0.0, tl.float32)     # kernel row 0
    g_mid = tl.full((JC, BLOCK_N), 0.0, tl.float32)    # kernel row 1
    g_hi = tl.full((JC, BLOCK_N), 0.0, tl.float32)     # kernel row 2
    for t in range(ROWS + 2):
        i = r0 - 1 + t                # the input row of this step
        o = i + 1                     # the dy row it meets through kernel row 0
        d_ok = img_ok & (o >= r0) & (o < r0 + ROWS)
        d_next = tl.load(dy_ptr + (base + o * W)[:, None] * K + offs_k[None, :],
                         mask=d_ok[:, None], other=0.0)
        at = _wide_tile_t(x_ptr, base, i, col, img_ok, j, sc, sh, H, W, C, CM, PROLOGUE)
        g_lo = tl.dot(at, d_next, g_lo)
        g_mid = tl.dot(at, d_cur, g_mid)
        g_hi = tl.dot(at, d_prev, g_hi)
        d_prev = d_cur
        d_cur = d_next
    # Row j of g_r is tap 3r + j // C, channel j % C: at k * 9CM + r * 3CM + (j // C) * CM + j % C in the
    # partials (k * 9C + r * 3C + j when CM = C).
    out = part_ptr + rest * (K * 9 * CM) + offs_k[None, :] * (9 * CM) + ((j // C) * CM + j % C)[:, None]
    ok = ((j < 3 * C) & (j % C < CM))[:, None]
    tl.store(out, g_lo, mask=ok)
    tl.store(out + 3 * CM, g_mid, mask=ok)
    tl.store(out + 6 * CM, g_hi, mask=ok)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _sum_partials_kernel(part_ptr, out_ptr, P, M, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr):
    """out[m] = sum over p of part[p, m] (float32), BLOCK_M columns per program, in a fixed order: the
    same result every run."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = tl.arange(0, BLOCK_P)
    acc = tl.full((BLOCK_P, BLOCK_M), 0.0, tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + offs_p
        ok = (p < P)[:, None] & (offs_m < M)[None, :]
        acc += tl.load(part_ptr + p[:, None] * M + offs_m[None, :], mask=ok, other=0.0)
    tl.store(out_ptr + offs_m, tl.reduce(acc, 0, _add), mask=offs_m < M)


# --------------------------------------------------------------------------------------------
# configurations

# A config: BM pixels per GEMM tile (images x W), SEGS row bands per image (ROWS = H / SEGS), BN
# output channels per program (K by default), num_warps, num_stages.
_CONFIG_KEYS = ("BM", "SEGS", "BN", "num_warps", "num_stages")
DEFAULT_FWD = {"BM": 64, "SEGS": 1, "num_warps": 4, "num_stages": 3}
DEFAULT_WGRAD = {"BM": 64, "SEGS": 1, "num_warps": 4, "num_stages": 2}

# The configuration the training step uses per op ("fprop", "dgrad", "wgrad") and convolution
# shape, keyed (op, N, C, K, H, W) with the layer's own C -> K (N = 0: any batch); ops and shapes
# not listed run cuDNN. Chosen from benchmarks/conv_rows_bench.py sweeps on an H100 (the shake-shake entries: an
# H200; both sm90) and
# used on GPUs of compute capability 9.x only (``fast_conv.apply_conv_kernels``).
CONFIGS: dict[tuple[str, int, int, int, int, int], dict[str, int]] = {
    # Chosen in a sweep on an H100, 2026-11-27, with the weight packed beforehand
    # (benchmarks/results/2026-11-27-h100-conv-rows-kernels.json), in us, ours / cuDNN; reading the
    # weight in the kernel adds 0-2.3 us (...-conv-rows-weight-in-kernel-table.json):
    ("fprop", 0, 32, 32, 32, 32): {"BM": 64, "SEGS": 1, "num_warps": 4, "num_stages": 3},   # 42.4 / 68.2
    ("dgrad", 0, 32, 32, 32, 32): {"BM": 64, "SEGS": 1, "num_warps": 4, "num_stages": 3},   # 42.7 / 62.1
    ("wgrad", 0, 32, 32, 32, 32): {"BM": 64, "SEGS": 1, "num_warps": 4, "num_stages": 2},   # 68.4 / 127.2
    ("fprop", 0, 64, 64, 16, 16): {"BM": 64, "SEGS": 1, "num_warps": 4, "num_stages": 3},   # 32.1 / 41.2
    ("dgrad", 0, 64, 64, 16, 16): {"BM": 64, "SEGS": 1, "num_warps": 4, "num_stages": 3},   # 31.8 / 34.7
    # The first block's 16 -> 32 convolution, swept on an H100 on 2026-11-27 with the weight read in the kernel
    # (benchmarks/results/2026-11-27-h100-conv-rows-c16-c128-kernels.json):
    ("fprop", 0, 16, 32, 32, 32): {"BM": 64, "SEGS": 2, "BN": 32, "num_warps": 4, "num_stages": 3},   # 29.5 / 69.8
    ("dgrad", 0, 16, 32, 32, 32): {"BM": 128, "SEGS": 2, "BN": 16, "num_warps": 8, "num_stages": 3},  # 36.9 / 63.5
    ("wgrad", 0, 16, 32, 32, 32): {"BM": 64, "SEGS": 2, "BN": 32, "num_warps": 4, "num_stages": 2},   # 54.9 / 101.5
    # cuDNN stays faster for wgrad at 64 channels (66.8 / 42.6) and for every op at 128 channels, 8x8: the
    # tiles that fit (32 pixels, 32-64 output channels) take fprop 68.3 / 24.9, dgrad 62.0 / 23.7, wgrad
    # 86.7 / 36.8. (A program of 4 images reads 192 KB of weight rows, 3 x 512 x 64, for 64 KB of input.)
    # The teacher's forward at batch 256: two row bands per image keep the GPU's SMs busy.
    ("fprop", 256, 32, 32, 32, 32): {"BM": 64, "SEGS": 2, "num_warps": 4, "num_stages": 3},  # 25.5 / 40.6
    ("fprop", 256, 64, 64, 16, 16): {"BM": 64, "SEGS": 2, "num_warps": 4, "num_stages": 3},  # 21.8 / 25.4
    ("fprop", 256, 16, 32, 32, 32): {"BM": 64, "SEGS": 4, "BN": 32, "num_warps": 4, "num_stages": 3},  # 18.6 / 39.8
    # The stem, on the images' 3 channels (a 4-channel tile; no input gradient), swept on an H100 on 2026-11-27
    # (benchmarks/results/2026-11-27-h100-conv-rows-stem-kernels.json):
    ("fprop", 0, 3, 16, 32, 32): {"BM": 64, "SEGS": 4, "BN": 16, "num_warps": 4, "num_stages": 2},    # 17.4 / 81.2
    ("wgrad", 0, 3, 16, 32, 32): {"BM": 64, "SEGS": 2, "BN": 16, "num_warps": 4, "num_stages": 2},    # 33.7 / 111.2 (*)
    ("fprop", 256, 3, 16, 32, 32): {"BM": 64, "SEGS": 4, "BN": 16, "num_warps": 4, "num_stages": 3},  # 14.6 / 44.6
    # (*) with the partial sums added by _sum_partials_kernel, swept again (...-conv-rows-stem-wgrad-resweep.json;
    # 40.1 with torch's sum)
    # The shake-shake WRN-26's first block: each branch's first convolution and the shortcut, 16 -> 96 at 32x32,
    # swept at N=512 (the student's stacked call; the folded teacher does not run them) on an H200 on 2026-11-28
    # (benchmarks/results/2026-11-28-h200-conv-rows-shakeshake-first-block.json):
    ("fprop", 0, 16, 96, 32, 32): {"BM": 128, "SEGS": 1, "BN": 32, "num_warps": 4, "num_stages": 3},   # 70.2 / 120.3
    ("wgrad", 0, 16, 96, 32, 32): {"BM": 128, "SEGS": 1, "BN": 32, "num_warps": 4, "num_stages": 1},   # 90.2 / 151.2
    # (Its input gradient stays cuDNN's: the forward kernel on dy's 96 channels, padded to 128 in a trial build, took
    # 173.9 us against 123.7, ...-2026-11-28-h200-conv-rows-dgrad-96-channels.json.)
}
TUNED_CAPABILITY = 9   # the compute capability (major) the table was measured on


def tuned_config(op: str, n: int, c: int, k: int, h: int, w: int) -> dict[str, int] | None:
    """The table's configuration for ``op`` of a C -> K convolution of N images of H x W, or None
    (run cuDNN). The table is for GPUs of compute capability ``TUNED_CAPABILITY``: the trainer switches
    a model to these kernels only there (``fast_conv.apply_conv_kernels``)."""
    return CONFIGS.get((op, n, c, k, h, w)) or CONFIGS.get((op, 0, c, k, h, w))


def _resolve(config: dict | None, default: dict, h: int, w: int, k: int) -> tuple[int, int, int, dict]:
    """(images per program, rows per program, output-channel tile, launch options) of a config;
    ValueError if it does not fit the shape."""
    cfg = dict(default if config is None else config)
    unknown = sorted(set(cfg) - set(_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"unknown config keys {unknown}; known: {', '.join(_CONFIG_KEYS)}")
    bm, segs, bn = cfg.get("BM", default["BM"]), cfg.get("SEGS", 1), cfg.get("BN", k)
    launch = {key: cfg[key] for key in ("num_warps", "num_stages") if key in cfg}
    if w < 1 or w & (w - 1):
        raise ValueError(f"the row kernels need a power-of-two width W, got {w}")
    if bm < 16 or bm & (bm - 1) or bm % w:
        raise ValueError(f"config BM={bm} must be a power of two >= 16 and a multiple of W={w}")
    if segs < 1 or h % segs:
        raise ValueError(f"config SEGS={segs} must divide H={h}")
    if bn < 16 or bn & (bn - 1) or k % bn:
        raise ValueError(f"config BN={bn} must be a power of two >= 16 dividing the {k} output channels")
    return bm // w, h // segs, bn, ({} if INTERPRET else launch)


def supports(shape: tuple[int, ...], k: int, config: dict | None = None) -> bool:
    """Whether the kernels take an (N, C, H, W) activation with k output channels (and config)."""
    if len(shape) != 4:
        return False
    _, c, h, w = shape
    try:
        _tile_channels(c, k)
        _resolve(config, DEFAULT_FWD, h, w, k)
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------------------------
# host side


def _check_activation(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must be 4-D (N, C, H, W), got shape {tuple(t.shape)}")
    if t.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32")
    if t.device.type != "cuda" and not INTERPRET:
        raise ValueError(f"{name} is on {t.device}: the kernels need a CUDA tensor (CPU tensors run "
                         f"only in Triton's interpreter: TRITON_INTERPRET=1 before importing this module)")
    if not t.is_contiguous(memory_format=torch.channels_last):
        raise ValueError(f"{name} must be in torch.channels_last memory format (NHWC in memory); "
                         f"got strides {t.stride()} for shape {tuple(t.shape)}: "
                         f"use {name}.contiguous(memory_format=torch.channels_last)")
    if t.numel() >= _INT32_LIMIT:
        raise ValueError(f"{name} has {t.numel()} elements; int32 indexing allows fewer than 2**31")


def _tile_channels(c: int, k: int) -> int:
    """The channels of the kernels' wide tile for C input channels: C, a power of two >= 4, or 4 for
    1-3 (an image's; the tile's other columns are zero). ValueError for other C or K."""
    if c < 1 or (c >= 4 and c & (c - 1)):
        raise ValueError(f"the row kernels need a power-of-two number of input channels >= 4 (or 1-3, an "
                         f"image's), got {c}")
    if k % 16:
        raise ValueError(f"the row kernels need a multiple of 16 output channels, got {k}")
    return max(c, 4)


def _check_affine(scale: torch.Tensor | None, shift: torch.Tensor | None, n: int, c: int, tile_c: int, imgs: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(scale, shift as contiguous float32 (S, C), images per segment), or None without a prologue."""
    if scale is None and shift is None:
        return None
    if tile_c != c:
        raise ValueError(f"the batch-norm + ReLU prologue needs a power-of-two number of channels >= 4, got {c}")
    if scale is None or shift is None:
        raise ValueError("scale and shift go together: pass both (the prologue) or neither")
    if not isinstance(scale, torch.Tensor) or not isinstance(shift, torch.Tensor) or scale.shape != shift.shape \
            or scale.dim() not in (1, 2) or scale.shape[-1] != c:
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in (scale, shift)]
        raise ValueError(f"scale and shift must both be (C,) or (S, C) with C = {c}, got {shapes[0]} and {shapes[1]}")
    if scale.device != device or shift.device != device:
        raise ValueError(f"scale and shift must be on {device}, got {scale.device} and {shift.device}")
    segments = 1 if scale.dim() == 1 else scale.shape[0]
    if segments < 1 or n % segments or (segments > 1 and (n // segments) % imgs):
        raise ValueError(f"{segments} segments of the {n} images must each hold a whole number of the "
                         f"config's {imgs}-image tiles")
    as_rows = [t.reshape(segments, c).to(torch.float32).contiguous() for t in (scale, shift)]
    return as_rows[0], as_rows[1], n // segments


def _check_weight(w: torch.Tensor, device: torch.device) -> None:
    if not isinstance(w, torch.Tensor) or w.dim() != 4 or tuple(w.shape[2:]) != (3, 3):
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"only 3x3 kernels are supported: w must have shape (K, C, 3, 3), got {shape}")
    if w.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"w has dtype {w.dtype}; supported: float16, bfloat16, float32")
    if w.device != device:
        raise ValueError(f"w is on {w.device} but the activation is on {device}")


def _launch_fwd(x: torch.Tensor, w: torch.Tensor, k: int, w_args: tuple[int, ...],
                affine_in: tuple[torch.Tensor | None, torch.Tensor | None], config: dict | None) -> torch.Tensor:
    n, c, h, wd = x.shape
    ct = _tile_channels(c, k)
    imgs, rows, bn, launch = _resolve(config, DEFAULT_FWD, h, wd, k)
    affine = _check_affine(*affine_in, n, c, ct, imgs, x.device)
    if n * k * h * wd >= _INT32_LIMIT:
        raise ValueError(f"the output would have {n * k * h * wd} elements; int32 indexing allows fewer than 2**31")
    y = torch.empty((n, k, h, wd), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    grid = (triton.cdiv(n, imgs) * (h // rows) * (k // bn),)
    sc, sh, seg = affine if affine is not None else (y, y, n)   # unread without the prologue
    _LAST_KERNEL["fwd"] = _conv_rows_fwd_kernel[grid](
        x, w, y, sc, sh, n, seg, *w_args, H=h, W=wd, C=ct, K=k, IMGS=imgs, ROWS=rows, BLOCK_N=bn,
        PROLOGUE=affine is not None, CM=c, **launch)
    return y


def conv3x3_rows_fwd(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
                     shift: torch.Tensor | None = None, *, config: dict | None = None) -> torch.Tensor:
    """conv2d(a, w, stride 1, padding 1, no bias) with a = x, or a = relu(x * scale + shift) per channel
    (the "prologue": computed in float32 while loading, rounded to x's dtype, zero padding after it;
    scale and shift (C,), or (S, C) for S equal segments of the batch, each with its own). x: (N, C, H, W)
    channels_last; w: (K, C, 3, 3) in any layout and float dtype, cast to x's dtype as the kernel reads
    it. Returns (N, K, H, W) channels_last in x's dtype. ``config`` overrides the default tile
    configuration (see ``CONFIGS``)."""
    _check_activation("x", x)
    _check_weight(w, x.device)
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"w has {w.shape[1]} input channels but x has {x.shape[1]}")
    sk, sc, sr, ss = w.stride()
    return _launch_fwd(x, w, w.shape[0], (0, sr, ss, sc, sk), (scale, shift), config)


def conv3x3_rows_dgrad(dy: torch.Tensor, w: torch.Tensor, *, config: dict | None = None) -> torch.Tensor:
    """The input gradient (N, C, H, W), channels_last in dy's dtype, of y = conv2d(x, w, stride 1,
    padding 1) for dy (N, K, H, W) channels_last: the forward kernel on dy with the weight read
    flipped and its channels swapped."""
    _check_activation("dy", dy)
    _check_weight(w, dy.device)
    if w.shape[0] != dy.shape[1]:
        raise ValueError(f"w has {w.shape[0]} output channels but dy has {dy.shape[1]}")
    if w.shape[1] < 4:
        raise ValueError(f"no input gradient for a convolution of {w.shape[1]} input channels (a stem's, on images, "
                         f"needs none): the row kernels need 16 or more output channels")
    sk, sc, sr, ss = w.stride()
    # B_r[s * K + k, c] = w[k, c, 2 - r, 2 - s]
    return _launch_fwd(dy, w, w.shape[1], (2 * sr + 2 * ss, -sr, -ss, sk, sc), (None, None), config)


def conv3x3_rows_wgrad(dy: torch.Tensor, x: torch.Tensor, scale: torch.Tensor | None = None,
                       shift: torch.Tensor | None = None, *, config: dict | None = None) -> torch.Tensor:
    """The weight gradient dw (K, C, 3, 3), float32, of y = conv2d(a, w, padding=1) given dy, with a = x
    or relu(x * scale + shift) as in ``conv3x3_rows_fwd``; dy and x (N, ·, H, W) channels_last. dw is in
    channels_last memory format (K, 3, 3, C in memory). Deterministic: per-program partial sums, added
    by one reduction."""
    _check_activation("dy", dy)
    _check_activation("x", x)
    if dy.device != x.device or dy.dtype != x.dtype:
        raise ValueError(f"dy and x must share device and dtype, got ({dy.device}, {dy.dtype}) "
                         f"and ({x.device}, {x.dtype})")
    n, c, h, w = x.shape
    if (dy.shape[0], dy.shape[2], dy.shape[3]) != (n, h, w):
        raise ValueError(f"dy {tuple(dy.shape)} and x {tuple(x.shape)} must share N, H and W "
                         f"(stride 1, padding 1)")
    k = dy.shape[1]
    ct = _tile_channels(c, k)
    imgs, rows, bn, launch = _resolve(config, DEFAULT_WGRAD, h, w, k)
    affine = _check_affine(scale, shift, n, c, ct, imgs, x.device)
    programs = triton.cdiv(n, imgs) * (h // rows)
    part = torch.empty((programs, k, 9, c), dtype=torch.float32, device=x.device)
    grid = (programs * (k // bn),)
    sc, sh, seg = affine if affine is not None else (part, part, n)   # unread without the prologue
    _LAST_KERNEL["wgrad"] = _conv_rows_wgrad_kernel[grid](
        dy, x, part, sc, sh, n, seg, H=h, W=w, C=ct, K=k, IMGS=imgs, ROWS=rows, BLOCK_N=bn,
        PROLOGUE=affine is not None, CM=c, **launch)
    return _sum_partials(part).view(k, 3, 3, c).permute(0, 3, 1, 2)


# The partial sums' reduction: elements a program loads at once (rows x columns), rows at most. Swept on an H100
# (2026-11-27, benchmarks/results/2026-11-27-h100-partial-sums.json): 9.9-10.8 us for the 32- and 16-channel
# layers' 9-9.4 MB of partial sums (torch's sum over the leading dimension: 16.1-24.2), 6.7-7.8 for the stem's
# 0.9 MB (22.8).
SUM_TILE = 8192
SUM_MAX_ROWS = 512


def _sum_partials(part: torch.Tensor, tile: int = SUM_TILE, max_rows: int = SUM_MAX_ROWS,
                  num_warps: int = 4) -> torch.Tensor:
    """part.sum(dim=0) for the weight gradient's float32 (programs, ...) partial sums, in one pass of our own, the
    same result every run. Each program loads all the rows (up to ``max_rows`` at a time) of a few columns at
    once: with few columns (the stem's 432) a loop over the rows would leave the sum waiting on one load
    after another."""
    p, m = part.shape[0], part[0].numel()
    if part.numel() >= _INT32_LIMIT:
        raise ValueError(f"{part.numel()} partial sums; int32 indexing allows fewer than 2**31")
    block_p = min(triton.next_power_of_2(p), max_rows)
    block_m = max(16, tile // block_p)
    out = torch.empty(part.shape[1:], dtype=torch.float32, device=part.device)
    _sum_partials_kernel[(triton.cdiv(m, block_m),)](part, out, p, m, BLOCK_P=block_p, BLOCK_M=block_m,
                                                     **({} if INTERPRET else {"num_warps": num_warps}))
    return out


def kernel_info(name: str) -> dict[str, Any]:
    """Registers, spills and shared memory of the kernel the last ``name`` ("fwd" or "wgrad") call
    launched (for benchmark reports; empty under the interpreter)."""
    kernel = _LAST_KERNEL.get(name)
    info: dict[str, Any] = {attr: getattr(kernel, attr) for attr in ("n_regs", "n_spills") if hasattr(kernel, attr)}
    meta = getattr(kernel, "metadata", None)
    if meta is not None and hasattr(meta, "shared"):
        info["shared"] = meta.shared
    return info
