"""How fast could the shake-shake model's 3x3 convolutions be? Each against a plain GEMM of its own sizes.

A stride-1 3x3 convolution of N images of HxW, C -> K channels is an implicit GEMM of M = N*H*W rows, a
reduction of 9C and K columns (forward; the input gradient has the same sizes with C and K swapped; the weight
gradient is a K x 9C product reduced over M). cuDNN runs the first stage's (96 channels a branch) at about 0.6 of
the efficiency of the other stages. This script times, bf16 on the GPU, each convolution (cuDNN, tuned)
against cuBLAS's GEMM of the same sizes on a materialised operand (no im2col gather: the best an implicit
GEMM could do with a library's tiles), the GEMM with more columns, up to the next multiple of 64 or 64 more (does the
width alone cost?), and Inductor's Triton templates (max-autotune, Triton only) for the convolution and the
GEMM. If cuBLAS's GEMM at 96 columns is no faster than cuDNN's convolution, a kernel of our own has little to win.

It also times each convolution's forward as the input gradient of the transposed convolution
(``F.conv_transpose2d(x, w.transpose(0, 1).flip(2, 3), padding=1)``, the same sums, which cuDNN runs with its
input-gradient kernels) and its weight gradient with the roles of input and output gradient swapped (the weight
gradient of that transposed form, flipped back), and says how far each is from the plain form's result.

    python benchmarks/conv_gemm_bound.py [--no-triton] [--relu] [--shapes N]

Measured: benchmarks/results/ (see docs/performance.md).
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_required import require_gpu  # noqa: E402
from shakeshake_convs import grad, timed_us  # noqa: E402

# (name, images, C in, K out, side): the student's convolutions (512 images) of WRN-26 shake-shake 96x2d
SHAPES = (
    ("stage 1 second conv 96->96", 512, 96, 96, 32),
    ("stage 1 stacked first conv 96->192", 512, 96, 192, 32),
    ("stage 2 second conv 192->192", 512, 192, 192, 16),
    ("stage 3 second conv 384->384", 512, 384, 384, 8),
    ("teacher stage 1 second convs as one 192->96", 256, 192, 96, 32),
    ("stage 2 stacked first conv 192->384", 512, 192, 384, 16),
)


def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * scale


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def triton_only(fn):
    """fn compiled with Inductor's max-autotune choosing among its Triton templates only."""
    import torch._inductor.config as ic
    with ic.patch(max_autotune=True, max_autotune_gemm_backends="TRITON", max_autotune_conv_backends="TRITON"):
        compiled = torch.compile(fn, dynamic=False)
        compiled()   # compile and autotune under the patch
    return compiled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-triton", action="store_true", help="skip Inductor's Triton templates (no compiles)")
    parser.add_argument("--relu", action="store_true",
                        help="inputs through a ReLU (half zeros, as in the model) instead of plain normal values")
    parser.add_argument("--shapes", type=int, default=len(SHAPES), help="only the first this many shapes")
    args = parser.parse_args()
    require_gpu("conv_gemm_bound.py")
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.benchmark_limit = 0
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", flush=True)
    for name, n, c, k, side in SHAPES[:args.shapes]:
        m = n * side * side
        tflop = 2 * m * 9 * c * k / 1e12
        x = rnd(n, c, side, side).to(memory_format=torch.channels_last)
        if args.relu:
            x = x.relu()
        w = rnd(k, c, 3, 3, scale=0.03).to(memory_format=torch.channels_last)
        dy = rnd(n, k, side, side).to(memory_format=torch.channels_last)
        a = rnd(m, 9 * c)                         # the forward's operand, materialised
        b = rnd(9 * c, k, scale=0.03)
        kp = -(-k // 64) * 64 if k % 64 else k + 64    # the next multiple of 64, or 64 more
        bp = rnd(9 * c, kp, scale=0.03)
        ad = rnd(m, 9 * k)                        # the input gradient's operand
        bd = rnd(9 * k, c, scale=0.03)
        dyt = rnd(k, m)                           # the weight gradient's: K x M times M x 9C
        wt = w.transpose(0, 1).flip(2, 3).contiguous(memory_format=torch.channels_last)
        y, y_t = F.conv2d(x, w, padding=1), F.conv_transpose2d(x, wt, padding=1)
        dw = grad(x, w, dy, 1, 1)[1]
        dw_t = torch.ops.aten.convolution_backward(x, dy, wt, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                                   [False, True, False])[1].transpose(0, 1).flip(2, 3)
        print(f"  transposed forms: forward {rel(y_t, y):.1e}, weight grad {rel(dw_t, dw):.1e} from the plain forms "
              "(largest difference over largest value)", flush=True)
        del y, y_t, dw, dw_t
        rows = {
            "conv forward": timed_us(lambda: F.conv2d(x, w, padding=1)),
            "forward as transposed conv": timed_us(lambda: F.conv_transpose2d(x, wt, padding=1)),
            "GEMM forward": timed_us(lambda: a @ b),
            f"GEMM forward, {kp} columns": timed_us(lambda: a @ bp),
            "conv input grad": timed_us(lambda: grad(x, w, dy, 1, 0)),
            "GEMM input grad": timed_us(lambda: ad @ bd),
            "conv weight grad": timed_us(lambda: grad(x, w, dy, 1, 1)),
            "weight grad, roles swapped": timed_us(lambda: torch.ops.aten.convolution_backward(
                x, dy, wt, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, False])),
            "GEMM weight grad": timed_us(lambda: dyt @ a),
        }
        if not args.no_triton:
            for label, fn in (("Triton conv forward", lambda: F.conv2d(x, w, padding=1)),
                              ("Triton GEMM forward", lambda: a @ b)):
                try:
                    rows[label] = timed_us(triton_only(fn))
                except Exception as exc:   # a template that does not apply: say so, go on
                    print(f"  {label}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
        print(f"{name}, N={n}, {side}x{side}: M={m}, reduction {9 * c} (input grad {9 * k}), {k} columns, "
              f"{tflop * 1e3:.1f} GFLOP", flush=True)
        for label, us in rows.items():
            flop = tflop * (kp / k if "columns" in label else 1)
            print(f"  {label:28s} {us:8.1f} us  {tflop / us * 1e6:6.0f} TFLOP/s useful"
                  + (f" ({flop / us * 1e6:.0f} done)" if flop != tflop else ""), flush=True)


if __name__ == "__main__":
    main()
