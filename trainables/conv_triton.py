"""3x3 stride-1 pad-1 convolutions for channels_last tensors, written in Triton.

Why: the 3x3 convolutions of WRN-28-2 are small-channel (C = K = 32, 64, 128) and cuDNN runs them
at 10-33% of their memory bound on an H100; between them sit batch-norm + ReLU kernels that each read
and write a whole activation. These kernels are implicit GEMMs that aim to read the input about
once from device memory (the 3x3 halo is re-read from L1/L2) and can apply the preceding batch norm's
affine transform and ReLU while loading ("prologue"), so that activation never goes to memory,
and can return the per-channel sum and sum of squares of their output ("statistics epilogue"),
so the next batch norm's statistics pass can be skipped.

    y = conv3x3_fwd(x, w)                                   # F.conv2d(x, w, padding=1)
    y, s, ss = conv3x3_fwd(x, w, scale, shift, return_stats=True)
                                                            # conv of relu(x * scale + shift)
    dx = conv3x3_dgrad(dy, w)                               # input gradient
    dw = conv3x3_wgrad(dy, x, scale, shift)                 # weight gradient, float32

Layout: activations are (N, C, H, W) tensors in ``torch.channels_last`` memory format (NHWC in
memory); weights are (K, C, 3, 3). The GEMM view: M = N*H*W output pixels, the output channels
K, and a reduction over 9 taps x C input channels; accumulation is always float32.

Kernels (each one Triton program per tile):

- ``_fwd_kernel``: one program computes a [BLOCK_M pixels, BLOCK_N out-channels] tile of y;
  it walks 9 taps x C/BLOCK_K channel chunks in one flat loop (so Triton can software-pipeline
  the loads), loading the shifted [BLOCK_M, BLOCK_K] input tile (zero outside the image) and a
  [BLOCK_K, BLOCK_N] slice of the packed weight [9, C, K] and issuing one ``tl.dot``. Tiles are
  consecutive runs of pixels, i.e. whole image rows when BLOCK_M is a multiple of W, so the
  halo rows a tile re-reads were just read by it or its neighbour programs (L1/L2 hits).
  dgrad is the same kernel on dy with the spatially flipped, K/C-swapped weight.
- ``_wgrad_kernel``: split-K over M. Each program owns a group of TAPS taps (9, 3 or 1) x one
  [BLOCK_KO, BLOCK_C] channel tile and a contiguous chunk of M; it accumulates per tap the
  [K, C] partial dy^T @ a in fp32 registers over the whole chunk and ends with one relaxed fp32
  ``tl.atomic_add`` per element into a zeroed float32 buffer laid out (K, 3, 3, C) (the returned
  dw is (K, C, 3, 3) in channels_last format, so the atomics are contiguous). The programs that
  share a chunk are adjacent in launch order, so their re-reads of dy and x hit L2.
- The statistics epilogue stores per-tile partial sums (no atomics: thousands of programs
  adding onto K addresses serialise) that one small torch reduction sums.

Measured (H100, bf16, CUDA-graph replay with L2 flushed, benchmarks/conv_triton_bench.py,
2026-11-26, torch 2.11 / triton 3.6): against cuDNN, fprop and dgrad run 0.92-1.24x (1.15x
at N=512 C=32: 55.6 vs 63.8 us), wgrad 1.07-1.24x; they reach 12-36% of the memory bound. The
forward loads each tap's tile again (9x the input through L2 and shared memory), which caps it
near 55 us at C=32 whatever the tile shape or cache modifier; reading x once would need the
halo tile staged in shared memory, which plain Triton cannot slice. The prologue does not pay:
it is recomputed for each of the 9 taps (ALU-bound), so fused fprop is 0.74-1.08x of
compiled-pointwise + cuDNN, fused wgrad 0.81-1.16x. The statistics epilogue costs about as much
as the separate statistics pass it replaces (fused 0.86-1.11x of unfused).

Numerics: the prologue is computed in float32 and rounded to x's dtype before the dot; the zero
padding applies after the prologue (padded taps contribute 0, not relu(shift)). Statistics are
taken of y as stored (after rounding to its dtype). float32 inputs use ``tl.dot``'s default
input precision (TF32 on NVIDIA GPUs; exact under the interpreter). Indexing is int32, so
tensors of 2**31 elements or more are refused. The wgrad result is not bitwise deterministic
(float32 atomics).

Importing this module needs no GPU; with ``TRITON_INTERPRET=1`` set before the import the
kernels run on CPU tensors in Triton's interpreter (one tuning configuration, for tests).
"""
from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LAST_KERNEL: dict[str, Any] = {}   # the last launched kernel per name, for last_kernel_info
_INT32_LIMIT = 2**31


# --------------------------------------------------------------------------------------------
# kernels


# The kernels use only builtins of triton.language, none of its @jit-decorated standard library
# (tl.zeros, tl.cdiv, tl.sum): those are compiled or interpreted as chosen when triton itself was
# imported, so with them these kernels would fail in the interpreter whenever triton was imported
# (by torch.compile, say) before TRITON_INTERPRET was set.


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _put(ptr, val, ATOMIC: tl.constexpr):
    if ATOMIC:
        tl.atomic_add(ptr, val, sem="relaxed")
    else:
        tl.store(ptr, val)


@triton.jit
def _load_tap(x_ptr, scale, shift, offs_m, oh, ow, row_ok, offs_c, dh, dw,
              H: tl.constexpr, W: tl.constexpr, C: tl.constexpr, PROLOGUE: tl.constexpr,
              CACHE: tl.constexpr):
    """The [BLOCK_M, BLOCK_C] input tile of one tap (dh, dw in -1..1) for output pixels offs_m,
    with the optional relu(x * scale + shift) prologue; zero where the tap falls outside the image."""
    ih = oh + dh
    iw = ow + dw
    ok = row_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
    src = offs_m + (dh * W + dw)
    a = tl.load(x_ptr + src[:, None] * C + offs_c[None, :], mask=ok[:, None], other=0.0,
                cache_modifier=CACHE)
    if PROLOGUE:
        af = tl.maximum(a.to(tl.float32) * scale[None, :] + shift[None, :], 0.0)
        a = tl.where(ok[:, None], af, 0.0).to(x_ptr.dtype.element_ty)
    return a


@triton.jit
def _fwd_kernel(x_ptr, w_ptr, y_ptr, scale_ptr, shift_ptr, stats_ptr, M,
                H: tl.constexpr, W: tl.constexpr, C: tl.constexpr, K: tl.constexpr,
                PROLOGUE: tl.constexpr, STATS: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                CACHE: tl.constexpr = ""):
    """y[m, n] = sum over taps t and channels c of a[m shifted by t, c] * w[t, c, n]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < M
    ow = offs_m % W
    oh = (offs_m // W) % H
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    NUM_CK: tl.constexpr = C // BLOCK_K
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for i in range(9 * NUM_CK):
        tap = i // NUM_CK
        cc = (i - tap * NUM_CK) * BLOCK_K + offs_k
        if PROLOGUE:
            sc = tl.load(scale_ptr + cc)
            sh = tl.load(shift_ptr + cc)
        else:
            sc = tl.full((BLOCK_K,), 0.0, tl.float32)
            sh = tl.full((BLOCK_K,), 0.0, tl.float32)
        a = _load_tap(x_ptr, sc, sh, offs_m, oh, ow, row_ok, cc, tap // 3 - 1, tap % 3 - 1,
                      H, W, C, PROLOGUE, CACHE)
        b = tl.load(w_ptr + (tap * C + cc)[:, None] * K + offs_n[None, :])
        acc = tl.dot(a, b, acc)
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs_m[:, None] * K + offs_n[None, :], y, mask=row_ok[:, None])
    if STATS:
        # Per-tile partial sums, [2, K, tiles]: plain stores, summed over the contiguous tile
        # axis by the host (one small reduction); atomics from thousands of programs onto K
        # addresses would serialise.
        yf = tl.where(row_ok[:, None], y.to(tl.float32), 0.0)
        tiles = tl.num_programs(0)
        part = stats_ptr + offs_n * tiles + pid_m
        tl.store(part, tl.reduce(yf, 0, _add))
        tl.store(part + K * tiles, tl.reduce(yf * yf, 0, _add))


@triton.jit
def _wgrad_kernel(dy_ptr, x_ptr, dw_ptr, scale_ptr, shift_ptr, M,
                  H: tl.constexpr, W: tl.constexpr, C: tl.constexpr, K: tl.constexpr,
                  PROLOGUE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_KO: tl.constexpr,
                  BLOCK_M: tl.constexpr, TAPS: tl.constexpr, SPLIT: tl.constexpr,
                  ATOMIC: tl.constexpr, CACHE: tl.constexpr = ""):
    """dw[k, tap, c] += sum over this program's rows m of dy[m, k] * a[m shifted by tap, c].

    ATOMIC: add into dw_ptr (K, 3, 3, C); else store into the partial buffer dw_ptr
    (splits, K, 3, 3, C) at this program's split. SPLIT (programs per SM) only sizes the grid."""
    pid_g = tl.program_id(0)        # tap group x channel tiles (fastest: shares the chunk in L2)
    pid_s = tl.program_id(1)        # chunk of M
    n_split = tl.num_programs(1)
    NUM_G: tl.constexpr = 9 // TAPS
    NUM_CT: tl.constexpr = C // BLOCK_C
    g = pid_g % NUM_G
    rest = pid_g // NUM_G
    offs_c = (rest % NUM_CT) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_k = (rest // NUM_CT) * BLOCK_KO + tl.arange(0, BLOCK_KO)
    if PROLOGUE:
        sc = tl.load(scale_ptr + offs_c)
        sh = tl.load(shift_ptr + offs_c)
    else:
        sc = tl.full((BLOCK_C,), 0.0, tl.float32)
        sh = tl.full((BLOCK_C,), 0.0, tl.float32)

    tiles = (M + BLOCK_M - 1) // BLOCK_M
    per = (tiles + n_split - 1) // n_split
    t_start = pid_s * per
    t_end = tl.minimum(t_start + per, tiles)

    # TAPS == 1: tap g; TAPS == 3: kernel row g (taps 3g..3g+2); TAPS == 9: all taps.
    dh0 = g - 1
    if TAPS == 1:
        dh0 = g // 3 - 1
        dw0 = g % 3 - 1
    acc0 = tl.full((BLOCK_KO, BLOCK_C), 0.0, tl.float32)
    if TAPS >= 3:
        acc1 = tl.full((BLOCK_KO, BLOCK_C), 0.0, tl.float32)
        acc2 = tl.full((BLOCK_KO, BLOCK_C), 0.0, tl.float32)
    if TAPS == 9:
        acc3 = tl.full((BLOCK_KO, BLOCK_C), 0.0, tl.float32)
        acc4 = tl.full((BLOCK_KO, BLOCK_C), 0.0, tl.float32)
        acc5 = tl.full((BLOCK_KO, BLOCK_C), 0.0, tl.float32)
        acc6 = tl.full((BLOCK_KO, BLOCK_C), 0.0, tl.float32)
        acc7 = tl.full((BLOCK_KO, BLOCK_C), 0.0, tl.float32)
        acc8 = tl.full((BLOCK_KO, BLOCK_C), 0.0, tl.float32)

    for t in range(t_start, t_end):
        offs_m = t * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < M
        ow = offs_m % W
        oh = (offs_m // W) % H
        dy = tl.load(dy_ptr + offs_m[:, None] * K + offs_k[None, :], mask=row_ok[:, None], other=0.0)
        dyt = tl.trans(dy)
        if TAPS == 1:
            acc0 = tl.dot(dyt, _load_tap(x_ptr, sc, sh, offs_m, oh, ow, row_ok, offs_c, dh0, dw0,
                                         H, W, C, PROLOGUE, CACHE), acc0)
        elif TAPS == 3:
            acc0 = tl.dot(dyt, _load_tap(x_ptr, sc, sh, offs_m, oh, ow, row_ok, offs_c, dh0, -1,
                                         H, W, C, PROLOGUE, CACHE), acc0)
            acc1 = tl.dot(dyt, _load_tap(x_ptr, sc, sh, offs_m, oh, ow, row_ok, offs_c, dh0, 0,
                                         H, W, C, PROLOGUE, CACHE), acc1)
            acc2 = tl.dot(dyt, _load_tap(x_ptr, sc, sh, offs_m, oh, ow, row_ok, offs_c, dh0, 1,
                                         H, W, C, PROLOGUE, CACHE), acc2)
        else:
            acc0 = tl.dot(dyt, _load_tap(x_ptr, sc, sh, offs_m, oh, ow, row_ok, offs_c, -1, -1,
                                         H, W, C, PROLOGUE, CACHE), acc0)
            acc1 = tl.dot(dyt, _load_tap(x_ptr, sc, sh, offs_m, oh, ow, row_ok, offs_c, -1, 0,
                                         H, W, C, PROLOGUE, CACHE), acc1)
            acc2 = tl.dot(dyt, _load_tap(x_ptr, sc, sh, offs_m, oh, ow, row_ok, offs_c, -1, 1,
                                         H, W, C, PROLOGUE, CACHE), acc2)
            acc3 = tl.dot(dyt, _load_tap(x_ptr, sc, sh, offs_m, oh, ow, row_ok, offs_c, 0, -1,
                                         H, W, C, PROLOGUE, CACHE), acc3)
            acc4 = tl.dot(dyt, _load_tap(x_ptr, sc, sh, offs_m, oh, ow, row_ok, offs_c, 0, 0,
                                         H, W, C, PROLOGUE, CACHE), acc4)
            acc5 = tl.dot(dyt, _load_tap(x_ptr, sc, sh, offs_m, oh, ow, row_ok, offs_c, 0, 1,
                                         H, W, C, PROLOGUE, CACHE), acc5)
            acc6 = tl.dot(dyt, _load_tap(x_ptr, sc, sh, offs_m, oh, ow, row_ok, offs_c, 1, -1,
                                         H, W, C, PROLOGUE, CACHE), acc6)
            acc7 = tl.dot(dyt, _load_tap(x_ptr, sc, sh, offs_m, oh, ow, row_ok, offs_c, 1, 0,
                                         H, W, C, PROLOGUE, CACHE), acc7)
            acc8 = tl.dot(dyt, _load_tap(x_ptr, sc, sh, offs_m, oh, ow, row_ok, offs_c, 1, 1,
                                         H, W, C, PROLOGUE, CACHE), acc8)

    # dw layout (K, 3, 3, C): element (k, tap, c) at k * 9C + tap * C + c.
    out = dw_ptr + offs_k[:, None] * (9 * C) + offs_c[None, :]
    if not ATOMIC:
        out += pid_s * (9 * C * K)
    if TAPS == 1:
        _put(out + g * C, acc0, ATOMIC)
    elif TAPS == 3:
        _put(out + (3 * g) * C, acc0, ATOMIC)
        _put(out + (3 * g + 1) * C, acc1, ATOMIC)
        _put(out + (3 * g + 2) * C, acc2, ATOMIC)
    else:
        _put(out + 0 * C, acc0, ATOMIC)
        _put(out + 1 * C, acc1, ATOMIC)
        _put(out + 2 * C, acc2, ATOMIC)
        _put(out + 3 * C, acc3, ATOMIC)
        _put(out + 4 * C, acc4, ATOMIC)
        _put(out + 5 * C, acc5, ATOMIC)
        _put(out + 6 * C, acc6, ATOMIC)
        _put(out + 7 * C, acc7, ATOMIC)
        _put(out + 8 * C, acc8, ATOMIC)


# --------------------------------------------------------------------------------------------
# tuning configurations

# Most fp32 accumulator registers a wgrad config may hold per thread (255 is the hardware cap;
# operands, addresses and the dot's staging need the rest; 128 with C = K = 128 and one tap per
# program was still the fastest wgrad config measured, without spills).
_WGRAD_ACC_REGS = 128
# Channel tiles: forward reduction chunk (input channels per tl.dot) and output-channel tile.
_FWD_BLOCK_K_CAP = 64
_FWD_BLOCK_N_CAP = 128
_WGRAD_BLOCK_CAP = 128


def _fwd_configs() -> list[triton.Config]:
    """Chosen from a sweep on an H100 (benchmarks/conv_triton_bench.py --sweep): BLOCK_M 128 with
    3-4 stages is best or within 3% without the prologue at C = 32, 64, 128; with the prologue
    the unpipelined (num_stages=1) variants are best. BLOCK_M 256, other BLOCK_K/BLOCK_N and
    cache modifiers (.ca, .cg) did not help."""
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 32}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_M": 128}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 128}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 128}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 64}, num_warps=4, num_stages=1),
        triton.Config({"BLOCK_M": 128}, num_warps=4, num_stages=1),
        triton.Config({"BLOCK_M": 128}, num_warps=8, num_stages=1),
    ]


def _wgrad_configs() -> list[triton.Config]:
    """SPLIT: programs per SM over the whole grid (2 and 4 measured alike on an H100, 1 was up
    to 2x slower: too few warps in flight). From the same sweep: C=32 is best with all 9 taps
    per program, C=64 with 3, C=128 with 1; a two-pass reduction (partials stored, then
    summed) was 5-15% slower than the float32 atomics."""
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "TAPS": 9, "SPLIT": 2}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_M": 64, "TAPS": 9, "SPLIT": 2}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_M": 32, "TAPS": 3, "SPLIT": 2}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 64, "TAPS": 3, "SPLIT": 2}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_M": 128, "TAPS": 3, "SPLIT": 2}, num_warps=8, num_stages=1),
        triton.Config({"BLOCK_M": 32, "TAPS": 1, "SPLIT": 2}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 64, "TAPS": 1, "SPLIT": 2}, num_warps=8, num_stages=1),
        triton.Config({"BLOCK_M": 64, "TAPS": 1, "SPLIT": 2}, num_warps=4, num_stages=2),
    ]


def _wgrad_acc_regs(taps: int, block_c: int, block_ko: int, num_warps: int) -> float:
    return taps * block_c * block_ko / (32 * num_warps)


def _prune_wgrad(configs: list[triton.Config], named_args: dict, **kwargs: Any) -> list[triton.Config]:
    """Keep the configs whose accumulators fit in registers, and of those only the two largest
    tap groups (fewer taps per program means more re-reads of dy and x)."""
    args = {**named_args, **kwargs}
    bc, bko = args["BLOCK_C"], args["BLOCK_KO"]
    fit = [c for c in configs
           if _wgrad_acc_regs(c.kwargs["TAPS"], bc, bko, c.num_warps) <= _WGRAD_ACC_REGS]
    if not fit:
        return [min(configs, key=lambda c: _wgrad_acc_regs(c.kwargs["TAPS"], bc, bko, c.num_warps))]
    taps = sorted({c.kwargs["TAPS"] for c in fit}, reverse=True)[:2]
    return [c for c in fit if c.kwargs["TAPS"] in taps]


# The tuned launchers. STATS is not in the forward key: the statistics epilogue reuses the tile
# shape tuned without it (one compile instead of one per config); dgrad shares fwd's entries.
_fwd_tuned = triton.autotune(
    configs=_fwd_configs(), key=["M", "H", "W", "C", "K", "PROLOGUE"],
)(_fwd_kernel)
_wgrad_tuned = triton.autotune(
    configs=_wgrad_configs(), key=["M", "H", "W", "C", "K", "PROLOGUE"],
    reset_to_zero=["dw_ptr"], prune_configs_by={"early_config_prune": _prune_wgrad},
)(_wgrad_kernel)


# --------------------------------------------------------------------------------------------
# host side


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two that divides n, at most cap."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _check_activation(name: str, t: torch.Tensor, channels_name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must be 4-D (N, {channels_name}, H, W), got shape {tuple(t.shape)}")
    if t.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32")
    if t.device.type != "cuda" and not INTERPRET:
        raise ValueError(f"{name} is on {t.device}: the kernels need a CUDA tensor (CPU tensors run "
                         f"only in Triton's interpreter: TRITON_INTERPRET=1 before importing this module)")
    if not t.is_contiguous(memory_format=torch.channels_last):
        raise ValueError(f"{name} must be in torch.channels_last memory format (NHWC in memory); "
                         f"got strides {t.stride()} for shape {tuple(t.shape)}: "
                         f"use {name}.contiguous(memory_format=torch.channels_last)")
    ch = t.shape[1]
    if ch % 16 != 0:
        raise ValueError(f"{name} has {ch} channels ({channels_name}); the kernels need a multiple "
                         f"of 16 (tl.dot's smallest tile)")
    if t.numel() >= _INT32_LIMIT:
        raise ValueError(f"{name} has {t.numel()} elements; int32 indexing allows fewer than 2**31")


def _check_weight(w: torch.Tensor, k: int | None, c: int, device: torch.device) -> None:
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"w must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 4 or tuple(w.shape[2:]) != (3, 3):
        raise ValueError(f"only 3x3 kernels are supported: w must have shape (K, C, 3, 3), "
                         f"got {tuple(w.shape)}")
    if w.shape[1] != c:
        raise ValueError(f"w has {w.shape[1]} input channels but the activation has {c}")
    if k is not None and w.shape[0] != k:
        raise ValueError(f"w has {w.shape[0]} output channels but dy has {k}")
    if w.shape[0] % 16 != 0:
        raise ValueError(f"w has {w.shape[0]} output channels (K); the kernels need a multiple of 16")
    if not w.is_floating_point():
        raise ValueError(f"w must be floating point, got {w.dtype}")
    if w.device != device:
        raise ValueError(f"w is on {w.device} but the activation is on {device}")


def _check_affine(scale: torch.Tensor | None, shift: torch.Tensor | None, c: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """scale and shift as contiguous float32 (C,) tensors, or None when there is no prologue."""
    if scale is None and shift is None:
        return None
    if scale is None or shift is None:
        raise ValueError("scale and shift go together: pass both (prologue) or neither")
    out = []
    for name, t in (("scale", scale), ("shift", shift)):
        if not isinstance(t, torch.Tensor) or t.numel() != c:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a tensor of {c} per-channel values, got {shape}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the activation is on {device}")
        out.append(t.reshape(c).to(torch.float32).contiguous())
    return out[0], out[1]


def pack_weight(w: torch.Tensor, dtype: torch.dtype, *, for_dgrad: bool = False) -> torch.Tensor:
    """The (K, C, 3, 3) weight as the kernels read it: a contiguous [9, C_in, C_out] tensor of
    ``dtype`` (tap = 3 * row + column). ``for_dgrad`` packs the spatially flipped weight with
    input and output channels swapped ([9, K, C]): the input gradient of a stride-1 pad-1
    convolution is a convolution of dy with that weight.

    A training step would fuse this into the weight's cast to bf16, so the benchmark times the
    kernels on packed weights; the public functions pack on each call."""
    if for_dgrad:
        w = w.flip(2, 3).transpose(0, 1)
    c_in, c_out = w.shape[1], w.shape[0]
    return w.permute(2, 3, 1, 0).reshape(9, c_in, c_out).to(dtype).contiguous()


def _split_config(config: dict | None, tile_keys: tuple[str, ...]) -> tuple[dict, dict, dict]:
    """A forced config as (kernel meta-parameters, launch options, host-chosen tile overrides)."""
    meta = dict(config or {})
    if config is not None and not isinstance(meta.get("BLOCK_M"), int):
        raise ValueError(f"a forced config needs an integer BLOCK_M, got {config}")
    launch = {key: meta.pop(key) for key in ("num_warps", "num_stages") if key in meta}
    tiles = {key: meta.pop(key) for key in tile_keys if key in meta}
    return meta, launch, tiles


def _check_tile(name: str, block: int, channels: int) -> None:
    if block < 16 or block & (block - 1) or channels % block:
        raise ValueError(f"config {name}={block} must be a power of two >= 16 dividing {channels}")


def _launch_fwd(x: torch.Tensor, wp: torch.Tensor, affine: tuple[torch.Tensor, torch.Tensor] | None,
                return_stats: bool, config: dict | None):
    n, c, h, w_ = x.shape
    k = wp.shape[2]
    m = n * h * w_
    y = torch.empty((n, k, h, w_), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    if y.numel() >= _INT32_LIMIT:
        raise ValueError(f"the output would have {y.numel()} elements; int32 indexing allows fewer than 2**31")
    meta, launch, tiles = _split_config(config, ("BLOCK_K", "BLOCK_N"))
    block_k = tiles.get("BLOCK_K", _pow2_divisor(c, _FWD_BLOCK_K_CAP))
    block_n = tiles.get("BLOCK_N", _pow2_divisor(k, _FWD_BLOCK_N_CAP))
    _check_tile("BLOCK_K", block_k, c)
    _check_tile("BLOCK_N", block_n, k)
    kw = dict(H=h, W=w_, C=c, K=k, PROLOGUE=affine is not None, STATS=return_stats,
              BLOCK_N=block_n, BLOCK_K=block_k)
    # Partial statistics [2, K, tiles]; the tile count depends on the tuned BLOCK_M, so size the
    # buffer for the smallest BLOCK_M any config uses and read back only the tiles written.
    min_bm = meta["BLOCK_M"] if config is not None else min(cf.kwargs["BLOCK_M"] for cf in _fwd_tuned.configs)
    stats = torch.empty(2 * triton.cdiv(m, min_bm) * k if return_stats else 1,
                        dtype=torch.float32, device=x.device)
    scale, shift = affine if affine is not None else (stats, stats)   # unread without the prologue
    used: dict[str, int] = {}

    def grid(meta_):
        used["tiles"] = triton.cdiv(m, meta_["BLOCK_M"])
        return (used["tiles"], k // block_n)

    if config is None:
        kernel = _fwd_tuned[grid](x, wp, y, scale, shift, stats, m, **kw)
    else:
        kernel = _fwd_kernel[grid(meta)](x, wp, y, scale, shift, stats, m, **kw, **meta, **launch)
    _LAST_KERNEL["fwd"] = kernel
    if not return_stats:
        return y
    s, ss = stats[: 2 * k * used["tiles"]].view(2, k, used["tiles"]).sum(dim=2)
    return y, s, ss


def conv3x3_fwd(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
                shift: torch.Tensor | None = None, *, return_stats: bool = False,
                config: dict | None = None):
    """y = conv2d(a, w, stride 1, padding 1, no bias) with a = x, or relu(x * scale[c] + shift[c])
    computed in float32 while loading and rounded to x's dtype (zero padding applied after it).

    x: (N, C, H, W) channels_last; w: (K, C, 3, 3) (cast to x's dtype). Returns y (N, K, H, W)
    channels_last of x's dtype; with ``return_stats`` also the float32 per-channel sum and sum of
    squares of y (as stored) over N, H, W. ``config`` forces a tile configuration, e.g.
    ``{"BLOCK_M": 64, "num_warps": 4}``, instead of autotuning (tests, experiments)."""
    _check_activation("x", x, "C")
    _check_weight(w, None, x.shape[1], x.device)
    affine = _check_affine(scale, shift, x.shape[1], x.device)
    return _launch_fwd(x, pack_weight(w, x.dtype), affine, return_stats, config)


def conv3x3_fwd_packed(x: torch.Tensor, wp: torch.Tensor, scale: torch.Tensor | None = None,
                       shift: torch.Tensor | None = None, *, return_stats: bool = False,
                       config: dict | None = None):
    """``conv3x3_fwd`` on a weight already packed by ``pack_weight`` (no per-call repacking);
    with a ``for_dgrad`` packing this computes the input gradient."""
    _check_activation("x", x, "C")
    c = x.shape[1]
    if wp.dim() != 3 or wp.shape[0] != 9 or wp.shape[1] != c or not wp.is_contiguous():
        raise ValueError(f"wp must be a contiguous packed weight of shape (9, {c}, K) "
                         f"(see pack_weight), got {tuple(wp.shape)}")
    if wp.dtype != x.dtype or wp.device != x.device:
        raise ValueError(f"wp must match x's dtype and device ({x.dtype}, {x.device}), "
                         f"got ({wp.dtype}, {wp.device})")
    if wp.shape[2] % 16 != 0:
        raise ValueError(f"wp has {wp.shape[2]} output channels; the kernels need a multiple of 16")
    affine = _check_affine(scale, shift, c, x.device)
    return _launch_fwd(x, wp, affine, return_stats, config)


def conv3x3_dgrad(dy: torch.Tensor, w: torch.Tensor, *, config: dict | None = None) -> torch.Tensor:
    """The input gradient dx (N, C, H, W) channels_last of the stride-1 pad-1 convolution with
    weight w (K, C, 3, 3), given dy (N, K, H, W) channels_last: the forward kernel run on dy with
    the flipped, channel-swapped weight."""
    _check_activation("dy", dy, "K")
    if not isinstance(w, torch.Tensor) or w.dim() != 4 or tuple(w.shape[2:]) != (3, 3):
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"only 3x3 kernels are supported: w must have shape (K, C, 3, 3), got {shape}")
    _check_weight(w, dy.shape[1], w.shape[1], dy.device)
    if w.shape[1] % 16 != 0:
        raise ValueError(f"w has {w.shape[1]} input channels (C); the kernels need a multiple of 16")
    return _launch_fwd(dy, pack_weight(w, dy.dtype, for_dgrad=True), None, False, config)


def conv3x3_wgrad(dy: torch.Tensor, x: torch.Tensor, scale: torch.Tensor | None = None,
                  shift: torch.Tensor | None = None, *, config: dict | None = None) -> torch.Tensor:
    """The weight gradient dw (K, C, 3, 3), float32, of y = conv3x3(a, w), given dy (N, K, H, W)
    and x (N, C, H, W), both channels_last, where a = x or relu(x * scale + shift) as in
    ``conv3x3_fwd``. dw is returned in channels_last memory format (K, 3, 3, C in memory; call
    ``.contiguous()`` for the default layout). ``config`` forces e.g.
    ``{"BLOCK_M": 64, "TAPS": 3, "num_warps": 4}`` instead of autotuning."""
    _check_activation("dy", dy, "K")
    _check_activation("x", x, "C")
    if dy.device != x.device or dy.dtype != x.dtype:
        raise ValueError(f"dy and x must share device and dtype, got ({dy.device}, {dy.dtype}) "
                         f"and ({x.device}, {x.dtype})")
    n, c, h, w_ = x.shape
    if (dy.shape[0], dy.shape[2], dy.shape[3]) != (n, h, w_):
        raise ValueError(f"dy {tuple(dy.shape)} and x {tuple(x.shape)} must share N, H and W "
                         f"(stride 1, padding 1)")
    k = dy.shape[1]
    affine = _check_affine(scale, shift, c, x.device)
    m = n * h * w_
    meta, launch, tiles = _split_config(config, ("BLOCK_C", "BLOCK_KO", "ATOMIC"))
    block_c = tiles.get("BLOCK_C", _pow2_divisor(c, _WGRAD_BLOCK_CAP))
    block_ko = tiles.get("BLOCK_KO", _pow2_divisor(k, _WGRAD_BLOCK_CAP))
    _check_tile("BLOCK_C", block_c, c)
    _check_tile("BLOCK_KO", block_ko, k)
    channel_tiles = (c // block_c) * (k // block_ko)
    sms = _num_sms(x.device)

    def grid(meta_):
        groups = (9 // meta_["TAPS"]) * channel_tiles
        tiles_m = triton.cdiv(m, meta_["BLOCK_M"])
        return (groups, max(1, min(tiles_m, triton.cdiv(meta_.get("SPLIT", 2) * sms, groups))))

    kw = dict(H=h, W=w_, C=c, K=k, PROLOGUE=affine is not None, BLOCK_C=block_c, BLOCK_KO=block_ko)
    if config is None:
        dw = torch.zeros((k, 3, 3, c), dtype=torch.float32, device=x.device)
        scale_t, shift_t = affine if affine is not None else (dw, dw)   # unread without the prologue
        kernel = _wgrad_tuned[grid](dy, x, dw, scale_t, shift_t, m, **kw, ATOMIC=True)
    else:
        if meta.get("TAPS") not in (1, 3, 9):
            raise ValueError(f"config TAPS must be 1, 3 or 9, got {meta.get('TAPS')}")
        meta.setdefault("SPLIT", 2)
        atomic = bool(tiles.get("ATOMIC", True))
        g = grid(meta)
        dw = torch.zeros((k, 3, 3, c) if atomic else (g[1], k, 3, 3, c), dtype=torch.float32,
                         device=x.device)
        scale_t, shift_t = affine if affine is not None else (dw, dw)
        kernel = _wgrad_kernel[g](dy, x, dw, scale_t, shift_t, m, **kw, **meta, ATOMIC=atomic, **launch)
        if not atomic:
            dw = dw.sum(dim=0)
    _LAST_KERNEL["wgrad"] = kernel
    return dw.permute(0, 3, 1, 2)


def last_kernel_info(name: str) -> dict[str, Any]:
    """Registers, spills, shared memory and whether Hopper's warp-group MMA (wgmma) is used, of
    the kernel the last ``name`` ("fwd" or "wgrad") call launched (for benchmark reports; empty
    under the interpreter or where this Triton version does not expose them)."""
    kernel = _LAST_KERNEL.get(name)
    info: dict[str, Any] = {}
    for attr in ("n_regs", "n_spills"):
        if hasattr(kernel, attr):
            info[attr] = getattr(kernel, attr)
    meta = getattr(kernel, "metadata", None)
    if meta is not None and hasattr(meta, "shared"):
        info["shared"] = meta.shared
    asm = getattr(kernel, "asm", None)
    if isinstance(asm, dict) and "ttgir" in asm:
        info["wgmma"] = "warp_group_dot" in asm["ttgir"]
    return info


def tuned_configs() -> dict[str, dict[str, str]]:
    """The configuration autotuning chose for each key so far, per kernel (for benchmark reports)."""
    out: dict[str, dict[str, str]] = {}
    for name, tuner in (("fwd", _fwd_tuned), ("wgrad", _wgrad_tuned)):
        cache = getattr(tuner, "cache", {}) or {}
        out[name] = {str(key): str(cfg) for key, cfg in cache.items()}
    return out
