"""The shake-shake model's convolutions in other forms, timed alone on a GPU (bf16, channels_last, cuDNN tuned):

- a student block's two second convolutions (C -> C each, 512 images) run one by one, against one grouped
  convolution (groups=2) over both branches' 2C channels: forward, input gradient, weight gradient;
- the teacher's (256 images) two second convolutions against one dense 2C -> C convolution (their eval-mode
  average, ``ShakeShakeBlock.folded``);
- the teacher's stacked first convolution with bias and ReLU as three eager kernels, against cuDNN's fused
  ``torch.cudnn_convolution_relu`` (``trainables.fast.conv_bias_relu``).

    python benchmarks/shakeshake_convs.py

Measured: benchmarks/results/2026-11-27-h100-shakeshake-convs.txt (docs/performance.md; two H100 hosts, the first by a
probe making the same calls before this script was written).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_required import require_gpu  # noqa: E402

STAGES = ((96, 32), (192, 16), (384, 8))   # WRN-26 shake-shake 96x2d: channels per branch, image side


def timed_us(fn, iters: int = 40) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def nhwc(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * scale).to(memory_format=torch.channels_last)


def grad(x, w, dy, groups, which):
    """The input (which 0) or weight (which 1) gradient of a stride-1, padding-1 convolution."""
    mask = [which == 0, which == 1, False]
    return torch.ops.aten.convolution_backward(dy, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], groups, mask)


def main() -> None:
    require_gpu("shakeshake_convs.py")
    torch.backends.cudnn.benchmark = True
    print(torch.cuda.get_device_name(), torch.__version__)
    for c, side in STAGES:
        n = 512
        h = nhwc(n, 2 * c, side, side)
        ha, hb = (part.contiguous(memory_format=torch.channels_last) for part in h.split(c, dim=1))
        wa, wb = nhwc(c, c, 3, 3, scale=0.03), nhwc(c, c, 3, 3, scale=0.03)
        wg = torch.cat([wa, wb]).contiguous(memory_format=torch.channels_last)
        dy, dy2 = nhwc(n, c, side, side), nhwc(n, 2 * c, side, side)
        tflop = 2 * n * side * side * c * c * 9 * 2 / 1e12   # both branches
        fwd = timed_us(lambda: (F.conv2d(ha, wa, padding=1), F.conv2d(hb, wb, padding=1)))
        fwd_view = timed_us(lambda: (F.conv2d(h[:, :c], wa, padding=1), F.conv2d(h[:, c:], wb, padding=1)))
        fwd_g = timed_us(lambda: F.conv2d(h, wg, padding=1, groups=2))
        dgrad = timed_us(lambda: (grad(ha, wa, dy, 1, 0), grad(hb, wb, dy, 1, 0)))
        dgrad_g = timed_us(lambda: grad(h, wg, dy2, 2, 0))
        wgrad = timed_us(lambda: (grad(ha, wa, dy, 1, 1), grad(hb, wb, dy, 1, 1)))
        wgrad_g = timed_us(lambda: grad(h, wg, dy2, 2, 1))
        print(f"student C={c} {side}x{side} N={n}, two {c}->{c} convs: forward {fwd:.0f} us ({tflop / fwd * 1e6:.0f} "
              f"TFLOP/s; on channel-slice views {fwd_view:.0f}), grouped {fwd_g:.0f} | input gradient {dgrad:.0f}, "
              f"grouped {dgrad_g:.0f} | weight gradient {wgrad:.0f}, grouped {wgrad_g:.0f}", flush=True)
        n = 256
        ht = nhwc(n, 2 * c, side, side)
        hta, htb = (part.contiguous(memory_format=torch.channels_last) for part in ht.split(c, dim=1))
        wd = torch.cat([wa, wb], 1).contiguous(memory_format=torch.channels_last)
        two = timed_us(lambda: (F.conv2d(hta, wa, padding=1), F.conv2d(htb, wb, padding=1)))
        dense = timed_us(lambda: F.conv2d(ht, wd, padding=1))
        x, w1 = nhwc(n, c, side, side), nhwc(2 * c, c, 3, 3, scale=0.03)
        b1 = torch.randn(2 * c, device="cuda", dtype=torch.bfloat16)
        plain = timed_us(lambda: F.relu(F.conv2d(x, w1, b1, padding=1)))
        fused = timed_us(lambda: torch.cudnn_convolution_relu(x, w1, b1, [1, 1], [1, 1], [1, 1], 1))
        diff = (torch.cudnn_convolution_relu(x, w1, b1, [1, 1], [1, 1], [1, 1], 1).float()
                - F.relu(F.conv2d(x, w1, b1, padding=1)).float()).abs().max().item()
        print(f"  teacher N={n}: second convs one by one {two:.0f} us, as one {2 * c}->{c} {dense:.0f} | first conv "
              f"{c}->{2 * c} + bias + ReLU, three eager kernels {plain:.0f}, cuDNN fused {fused:.0f} "
              f"(max difference {diff:.3g})", flush=True)


if __name__ == "__main__":
    main()
