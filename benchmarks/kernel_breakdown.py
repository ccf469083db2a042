"""Where the GPU time of a training step goes, and which layout of the student's passes is fastest.

Layouts: forward + backward of the student (no optimiser, no teacher) replayed as one CUDA graph, bf16
autocast, channels_last, torch.compile with static shapes: two calls of 256 images (the reference's
layout), one call of 512 with joint batch norm (a different model, for comparison only), one stacked
call of 512 with per-batch batch norm (``SegmentedBatchNorm2d``, what the trainer does: one pass over
the stack), the same with one batch-norm call per batch and a concatenation, and variants; prints ms
per pass and a profile of kernel classes (cuDNN fprop/dgrad/wgrad, Triton, other).

The trainer's own step, by the same kernel classes: ``benchmarks/profile_step.py``.

    python benchmarks/kernel_breakdown.py [--quick]                     # on a GPU

Writes kernel_breakdown.json to $OUT or the current folder.
Measured output: benchmarks/results/2026-11-26-h100-kernel-breakdown*.json.
"""
import json
import os
import sys
import time
from pathlib import Path
import torch
import torch.nn.functional as F
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_required import require_gpu  # noqa: E402  (this folder: on sys.path when run as a script)
from trainables.fast.stored_grad import register_lowering  # noqa: E402
from trainables.fast.model_swaps import speed_up_model  # noqa: E402
from trainables.models import create_model  # noqa: E402
from trainables.models.segmented_bn import SegmentedBatchNorm2d, batch_segments  # noqa: E402

dev = torch.device("cuda")
out = {}


class SplitBN(SegmentedBatchNorm2d):
    """Per-batch statistics by one batch-norm call per batch and a concatenation (the trainer before)."""

    def _equal_segments(self, x, relu=False):
        y = self._split_segments(x)
        return y.relu() if relu else y


class GroupVarBN(SegmentedBatchNorm2d):
    """Per-batch statistics by one grouped var_mean, backward derived by autograd (slower)."""

    def forward(self, x):
        if not self.training or self.segments is None:
            return super().forward(x)
        g = len(self.segments)
        xs = x.unflatten(0, (g, -1))
        var, mean = torch.var_mean(xs.float(), dim=(1, 3, 4), keepdim=True, correction=0)
        y = (xs - mean) * torch.rsqrt(var + self.eps) * self.weight.view(1, 1, -1, 1, 1) + self.bias.view(1, 1, -1, 1, 1)
        return y.to(x.dtype).flatten(0, 1)


def timed_graph(fn, iters=60):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e3, g


def bench(name, model_name="wrn28_2", bn=None, mode="two", batch=256, cl=True, compile_mode="default"):
    torch.manual_seed(0)
    m = speed_up_model(create_model(model_name, 10)).to(dev)   # the trainer's fast layers (trainables.fast.model_swaps)
    bns = [b for b in m.modules() if isinstance(b, SegmentedBatchNorm2d)]
    if bn is not None:   # a variant of the layer's forward, no state of its own
        for b in bns:
            b.__class__ = bn
    if cl:
        m = m.to(memory_format=torch.channels_last)
    fwd = torch.compile(m, mode=compile_mode, dynamic=False)
    fmt = torch.channels_last if cl else torch.contiguous_format
    xa = torch.randn(batch, 3, 32, 32, device=dev).contiguous(memory_format=fmt)
    xb = torch.randn(batch, 3, 32, 32, device=dev).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (batch,), device=dev)
    xab = torch.cat([xa, xb]).contiguous(memory_format=fmt)
    yab = torch.cat([y, y])

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            if mode == "two":
                loss = F.cross_entropy(fwd(xa).float(), y) + F.cross_entropy(fwd(xb).float(), y)
            elif mode == "one":
                loss = F.cross_entropy(fwd(xa).float(), y)
            elif mode == "teacher":
                with torch.no_grad():
                    return fwd(xa)
            elif mode == "split":
                with batch_segments(bns, ((batch, True), (batch, True))):
                    loss = F.cross_entropy(fwd(xab).float(), yab) * 2
            else:
                loss = F.cross_entropy(fwd(xab).float(), yab) * 2
        loss.backward()

    if mode == "teacher":
        m.eval()
    ms, g = timed_graph(step)
    out[name] = ms
    print(f"{name:50s} {ms:7.3f} ms", flush=True)
    (Path(os.environ.get("OUT", ".")) / "kernel_breakdown.json").write_text(json.dumps(out, indent=1))
    return g


def kernel_classes(events, steps):
    """GPU time and launches per step by kernel class, and (time, launches, name) per kernel, slowest
    first, from a profiler's ``key_averages()`` over ``steps`` steps."""
    cats = {}
    rows = []
    for e in events:
        t = e.self_device_time_total / steps
        if t <= 0 or e.device_type.name != "CUDA":
            continue
        n = e.key
        lo = n.lower()
        if lo.startswith("_conv_rows_fwd"):   # ours (trainables/fast/conv_rows.py): forward and input gradient
            c = "conv fprop+dgrad (ours)"
        elif lo.startswith("_conv_rows_wgrad"):
            c = "conv wgrad (ours)"
        elif lo.startswith("triton"):   # Inductor names kernels after the ops they fuse ("convolution_backward")
            c = "triton"
        elif "wgrad" in lo:
            c = "conv wgrad"
        elif "dgrad" in lo:
            c = "conv dgrad"
        elif "fprop" in lo or "conv" in lo or "implicit" in lo or "xmma" in lo or "cudnn" in lo:
            c = "conv fprop/other cudnn"
        elif "gemm" in lo or "cutlass" in lo:
            c = "gemm"
        else:
            c = "other"
        cats.setdefault(c, [0.0, 0])
        cats[c][0] += t
        cats[c][1] += e.count / steps
        rows.append((t, e.count / steps, n[:110]))
    rows.sort(reverse=True)
    return cats, rows


def print_classes(name, cats, rows, top=30):
    print(f"--- {name}: categories (us/step, kernels/step)")
    for c, (t, k) in sorted(cats.items(), key=lambda kv: -kv[1][0]):
        print(f"  {c:28s} {t:9.1f} us {k:6.0f}")
    for t, k, n in rows[:top]:
        print(f"  {t:8.1f} us {k:5.0f}x  {n}")


def profile(name, replay, steps=20):
    """GPU time per call of ``replay`` by kernel class, and the 30 slowest kernels."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            replay()
        torch.cuda.synchronize()
    cats, rows = kernel_classes(prof.key_averages(), steps)
    print_classes(name, cats, rows)
    out[name + "_cats"] = cats
    out[name + "_top"] = rows[:30]
    (Path(os.environ.get("OUT", ".")) / "kernel_breakdown.json").write_text(json.dumps(out, indent=1))


def main():
    require_gpu("kernel_breakdown.py")
    register_lowering()   # as the trainer does: the shake-shake blocks' stored input gradients (else a copy each)
    torch.backends.cudnn.benchmark = True
    print(torch.cuda.get_device_name(), torch.__version__, time.strftime("%Y-%m-%d"), flush=True)
    out["device"], out["torch"], out["date"] = torch.cuda.get_device_name(), torch.__version__, time.strftime("%Y-%m-%d")
    if "--quick" in sys.argv:   # the trainer's layout against the reference's, and where the time goes
        profile("wrn two-calls-256", bench("wrn two-calls-256").replay)
        profile("wrn stacked-512 one-pass BN", bench("wrn stacked-512 one-pass BN", mode="split").replay)
        profile("wrn stacked-512 split BN", bench("wrn stacked-512 split BN (per batch + cat)", bn=SplitBN,
                                                   mode="split").replay)
        return
    for bm in (True, False):
        torch.backends.cudnn.benchmark = bm
        g = bench(f"wrn two-calls-256 cudnn.benchmark={bm}")
        if bm:
            profile("wrn two-calls-256", g.replay)
    torch.backends.cudnn.benchmark = True
    bench("wrn one-call-256 (supervised)", mode="one")
    bench("wrn teacher fwd 256 eval", mode="teacher")
    profile("wrn one-call-512 joint BN", bench("wrn one-call-512 joint BN", mode="cat").replay)
    profile("wrn stacked-512 one-pass BN", bench("wrn stacked-512 one-pass BN", mode="split").replay)
    bench("wrn stacked-512 split BN (per batch + cat)", bn=SplitBN, mode="split")
    bench("wrn stacked-512 grouped var_mean BN", bn=GroupVarBN, mode="split")
    bench("wrn two-calls-256 max-autotune-no-cudagraphs", compile_mode="max-autotune-no-cudagraphs")
    bench("wrn two-calls-256 NCHW", cl=False)
    profile("shake two-calls-256", bench("shake two-calls-256", model_name="wrn26_6_shakeshake").replay)
    bench("shake stacked-512 one-pass BN", model_name="wrn26_6_shakeshake", mode="split")
    bench("shake stacked-512 split BN", model_name="wrn26_6_shakeshake", bn=SplitBN, mode="split")


if __name__ == "__main__":
    main()
