"""Profile the trainer's step on the GPU: where the time goes (by kernel class: cuDNN fprop, dgrad,
wgrad, Triton, other; and by kernel), GPU busy time vs wall time.

    python benchmarks/profile_step.py --model wrn28_2 --method cowmix [--no-compile] [--trace out.json]

A trace shows where the GPU waits and what runs beside what: ``python benchmarks/step_timeline.py out.json``.
With ``--serial`` every kernel runs on the main stream: the sum of their durations is the step's work, each
one measured alone. With ``--kernel-bytes`` the models compile afresh, into an Inductor cache directory of their
own, with Inductor's byte count in each kernel's code, and each kernel's bytes and bandwidth are printed too
(``benchmarks/kernel_bytes.py``). ``--variant V`` profiles the step with the switches of step_ab.py's variant V
turned on (an experiment) or off (its runner's own: ``step_ab.variant_switches``, ``build_variant_runner``).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernel_bytes  # noqa: E402
from kernel_breakdown import kernel_classes, print_classes  # noqa: E402
from gpu_required import require_gpu  # noqa: E402
from step_ab import (BLOCK_SWITCHES, BN_SWITCHES, FAST_SWITCHES, REFERENCE_LAYOUT,  # noqa: E402
                     build_variant_runner, variant_switches)
from throughput import load_images, make_config  # noqa: E402

from trainables.data import DeviceData, make_splits  # noqa: E402
from trainables.fast import wgrad_stream  # noqa: E402
from trainables.trainer import autotune_convolutions  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="wrn28_2")
    p.add_argument("--method", default="cowmix")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--compile-mode", default="reduce-overhead")
    p.add_argument("--cuda-graph", default="step", choices=("step", "model", "none"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=0, help="also list the N slowest kernels with launches per step")
    p.add_argument("--no-teacher-stream", action="store_true", help="run the teacher on the main stream")
    p.add_argument("--serial", action="store_true",
                   help="every kernel on the main stream (the teacher's, and the weight gradients': "
                        "wgrad_stream.SIDE_STREAM off), so no kernel's duration is stretched by one beside it")
    p.add_argument("--conv-kernels", default="triton", choices=("cudnn", "triton"),
                   help="the 3x3 convolutions: our Triton kernels where they beat cuDNN, or cuDNN "
                        "(train.fast.conv_kernels)")
    p.add_argument("--trace", help="write a Chrome trace here")
    p.add_argument("--untuned", action="store_true", help="no coordinate-descent tuning (a shorter compile)")
    p.add_argument("--kernel-bytes", action="store_true",
                   help="also each Inductor kernel's bytes and TB/s (compiles afresh, in a cache directory of its own)")
    p.add_argument("--bandwidth", type=float, default=kernel_bytes.BANDWIDTH,
                   help=f"--kernel-bytes: TB/s to set the bytes against ({kernel_bytes.BANDWIDTH})")
    p.add_argument("--reads", type=int, default=None, metavar="N",
                   help="compile the models under Inductor's realize_reads_threshold N "
                        "(train.fast.realize_reads_threshold) instead of the model's own")
    p.add_argument("--variant",
                   choices=sorted({*FAST_SWITCHES, *BLOCK_SWITCHES, *BN_SWITCHES, *REFERENCE_LAYOUT}),
                   help="with the switches of this step_ab.py variant on (experiments) or off (defaults)")
    args = p.parse_args()
    if args.reads is not None and args.reads < 1:
        p.error(f"--reads: Inductor's realize_reads_threshold must be >= 1, got {args.reads}")
    require_gpu("profile_step.py")
    return profile(args)


def profile(args) -> int:
    code_dir = None
    if args.kernel_bytes:   # before anything compiles: kernel names repeat across models, so this run's alone
        code_dir = Path(tempfile.mkdtemp(prefix="profile-step-inductor-"))
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(code_dir)
        import torch._inductor.config as inductor
        inductor.benchmark_kernel = True   # kernel_num_gb in each kernel's inductor_meta
    device = torch.device("cuda")
    if args.serial:
        wgrad_stream.SIDE_STREAM = False
    autotune_convolutions()   # as the trainer does unless train.deterministic
    raw = load_images(None, 20000)
    splits = make_splits(raw.train_labels, 0, 131, 1000, 0, raw.fingerprint)
    cfg = make_config(args.model, args.method, args.batch, "cuda", True, not args.no_compile, args.compile_mode,
                      args.cuda_graph, conv_kernels=args.conv_kernels, tune_kernels=False if args.untuned else None,
                      realize_reads_threshold=args.reads)
    switches = dataclasses.replace(variant_switches(args.variant),
                                   teacher_stream=not (args.no_teacher_stream or args.serial))
    runner = build_variant_runner(cfg, 10, device, args.variant, switches)
    data = DeviceData(raw, splits, True, 4, device)
    gen = runner.generator.manual_seed(0)
    it = iter(data.train_batches(0, 0, args.batch, 30 + args.steps, False))
    for _ in range(30):
        runner.step(next(it), gen, 0.05, 0.97)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            runner.step(next(it), gen, 0.05, 0.97)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps
    events = prof.key_averages()
    gpu_total = sum(e.self_device_time_total for e in events) / 1e6 / args.steps  # seconds
    kernels = sum(e.count for e in events if e.self_device_time_total > 0 and e.device_type.name == "CUDA")
    print(f"{args.model} {args.method} compile={not args.no_compile} cuda_graph={args.cuda_graph}"
          f"{f' variant {args.variant}' if args.variant else ''}"
          f"{f' reads {args.reads}' if args.reads is not None else ''}: wall {wall * 1e3:.2f} ms/step "
          f"({1 / wall:.1f} steps/s under the profiler), GPU busy {gpu_total * 1e3:.2f} ms/step "
          f"({gpu_total / wall:.0%}), {kernels / args.steps:.0f} kernels/step")
    print(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
    print_classes(f"{args.model} {args.method}", *kernel_classes(events, args.steps), top=args.top)
    if args.trace or code_dir:
        trace = Path(args.trace or code_dir / "trace.json")
        prof.export_chrome_trace(str(trace))
    if code_dir:
        print(f"\n--- Inductor's kernels: bytes and bandwidth (code in {code_dir})")
        found = kernel_bytes.kernel_bytes([code_dir])
        kernel_bytes.print_table(kernel_bytes.rows(kernel_bytes.load_trace(trace), found, args.steps), args.bandwidth,
                                 args.top or kernel_bytes.TOP)
    return 0


if __name__ == "__main__":
    sys.exit(main())
