"""The row-streaming 3x3 convolutions (trainables/fast/conv_rows.py) against cuDNN, on WRN-28-2's shapes.

For each shape (bf16, channels_last, stride 1, padding 1) and op (fprop, dgrad, wgrad) it times
cuDNN and every candidate tile configuration of the row kernel, each captured in a CUDA graph whose
replay is timed with triton.testing.do_bench (median; L2 flushed before every run), so Python and
launch overhead are not counted (the training step replays one CUDA graph too). Every result is
checked against cuDNN. It prints the best configuration per op with its fraction of the memory
bound (input + output bytes / peak bandwidth) and marks the configuration the trainer's table
(``conv_rows.CONFIGS``) holds.

    python benchmarks/conv_rows_bench.py --out results.json       # H100: about 3 minutes
    python benchmarks/conv_rows_bench.py --device cpu --tiny      # interpreter smoke test

Exit status 1 when a configuration that compiled disagreed with cuDNN (relative error over 2e-2)
or a shape failed; configurations the GPU cannot run (shared memory) are recorded and skipped.
"""
from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Peak HBM bandwidth by device name (vendors' datasheets, SXM parts); 3.35e12 when unknown.
PEAK_BW = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}
REL_ERR_FLAG = 2e-2
WRN_SHAPES = [  # (N, C, K, H, W): the student's stacked call (512) and the teacher's (256)
    (512, 32, 32, 32, 32), (512, 64, 64, 16, 16), (512, 128, 128, 8, 8),
    (256, 32, 32, 32, 32), (256, 64, 64, 16, 16), (256, 128, 128, 8, 8),
    (512, 16, 32, 32, 32), (256, 16, 32, 32, 32),    # the first block's first convolution
    (512, 3, 16, 32, 32), (256, 3, 16, 32, 32),      # the stem, on the images (no input gradient)
    (512, 16, 96, 32, 32),   # the shake-shake WRN-26's first block: each branch's first convolution, and the shortcut
]
IMAGE_OPS = ("fprop", "wgrad")   # the ops of a convolution on 1-3 channels (a stem's: its input needs no gradient)
SMEM_LIMIT = 232448   # bytes of shared memory a program may use on an H100 (227 KiB)
TINY_SHAPES = [(3, 16, 32, 8, 8), (2, 32, 16, 4, 16), (2, 3, 16, 4, 8)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu runs the kernels in Triton's interpreter (correctness only)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (float32 on cpu)")
    p.add_argument("--shapes", default="0,1,3,4",
                   help="comma-separated shape indices (0-5: N=512 C=32,64,128, then N=256; 6, 7: C=16 K=32 "
                        "at N=512, 256; 8, 9: the stem, C=3 K=16, at N=512, 256; 10: the shake-shake WRN-26's "
                        "C=16 K=96 at N=512)")
    p.add_argument("--ops", default="fprop,dgrad,wgrad,fprop_bn,wgrad_bn",
                   help="fprop, dgrad, wgrad, and fprop_bn, wgrad_bn: with the batch-norm + ReLU prologue")
    p.add_argument("--teacher-ops", default="fprop", help="ops timed at N=256 (the teacher only runs forward)")
    p.add_argument("--rep-ms", type=float, default=40.0, help="do_bench rep time per measurement")
    p.add_argument("--table-only", action="store_true",
                   help="time only the configuration the trainer's table holds for each op and shape")
    return p.parse_args(argv)


def _errors(out, ref) -> float:
    """max |out - ref| over max |ref| (in float32)."""
    out, ref = out.float(), ref.float()
    scale = ref.abs().max().item()
    max_abs = (out - ref).abs().max().item()
    return max_abs / scale if scale > 0 else float(max_abs > 0)


def time_graph(fn: Callable[[], Any], rep_ms: float) -> float:
    """Median microseconds of one replay of ``fn`` captured in a CUDA graph (L2 flushed before each)."""
    import torch
    import triton.testing

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = triton.testing.do_bench(graph.replay, warmup=max(5, int(rep_ms / 4)), rep=int(rep_ms))
    del graph
    return ms * 1e3


def candidate_configs(c: int, k: int, h: int, w: int, op: str, tiny: bool) -> list[dict[str, int]]:
    """Pixels per tile, row bands per image, output channels per program, warps, stages, for ``op`` of a
    C -> K convolution (the input gradient runs K -> C). Left out: forward-kernel tiles whose wide input
    tile and three weight rows (2 bytes an element) would not fit in shared memory, and weight-gradient
    tiles whose three float32 [4C, BN] sums would need over 200 registers a thread."""
    if tiny:
        return [{"BM": max(16, w), "SEGS": s} for s in (1, 2) if h % s == 0]
    c_in, c_out = (k, c) if op == "dgrad" else (max(c, 4), k)   # 1-3 channels: a 4-channel tile
    stages = (1, 2) if op == "wgrad" else (2, 3)
    bms = (32, 64, 128) if c_in >= 128 else (64, 128, 256, 512) if c_in <= 4 else (64, 128)
    bns = sorted({c_out, c_out // 2, c_out // 4, c_out // 8} if c_in >= 128 else {c_out, c_out // 2})
    bns = [b for b in bns if not b & (b - 1)] or [b for b in (16, 32, 64) if c_out % b == 0]   # 96: 32, 16
    out = []
    for bm, segs, bn, warps, st in itertools.product(bms, (1, 2, 4), bns, (4, 8), stages):
        fits = (12 * c_in * bn <= warps * 32 * 200) if op == "wgrad" else 2 * 4 * c_in * (3 * bn + bm) <= SMEM_LIMIT
        if bn >= 16 and bm % w == 0 and h % segs == 0 and h // segs >= 4 and fits:
            out.append({"BM": bm, "SEGS": segs, "BN": bn, "num_warps": warps, "num_stages": st})
    return out


def run_shape(shape, device, dtype, peak_bw: float, ops: list[str], tiny: bool, rep_ms: float,
              table_only: bool = False) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    import trainables.fast.conv_rows as cr

    n, c, k, h, w = shape
    cl = torch.channels_last
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, c, h, w, device=device, generator=g).to(dtype).contiguous(memory_format=cl)
    dy = torch.randn(n, k, h, w, device=device, generator=g).to(dtype).contiguous(memory_format=cl)
    wt = (torch.randn(k, c, 3, 3, device=device, generator=g) / math.sqrt(9 * c)).to(dtype)
    wt = wt.contiguous(memory_format=cl)   # as a channels_last model holds it
    wf = wt.float().contiguous(memory_format=cl)   # the kernels read a model's float32 weight and cast it

    def bwd(mask):
        return torch.ops.aten.convolution_backward(dy, x, wt, None, [1, 1], [1, 1], [1, 1], False,
                                                   [0, 0], 1, mask)

    # The batch-norm + ReLU prologue, per segment (the student's stacked call: two batches' statistics)
    segs = 2 if n % 2 == 0 else 1
    scale = 1.0 + 0.2 * torch.randn(segs, c, device=device, generator=g)
    shift = 0.2 * torch.randn(segs, c, device=device, generator=g)

    def bn_relu(t):
        v = t.view(segs, n // segs, c, h, w).float()
        return torch.relu(v * scale.view(segs, 1, c, 1, 1) + shift.view(segs, 1, c, 1, 1)).to(t.dtype).view(
            n, c, h, w).contiguous(memory_format=cl)

    bn_relu_c = torch.compile(bn_relu, dynamic=False) if device == "cuda" else bn_relu
    a = bn_relu(x)
    plain = {op: cr.CONFIGS.get((op, 0, c, k, h, w)) for op in ("fprop", "wgrad")}

    def cudnn_wgrad(inp):
        return torch.ops.aten.convolution_backward(dy, inp, wt, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                                   [False, True, False])[1]

    plans = {   # op: (cuDNN, row kernel with a config, the kernel_info name)
        "fprop": (lambda: F.conv2d(x, wt, padding=1), lambda cfg: cr.conv3x3_rows_fwd(x, wf, config=cfg), "fwd"),
        "dgrad": (lambda: bwd([True, False, False])[0], lambda cfg: cr.conv3x3_rows_dgrad(dy, wf, config=cfg),
                  "fwd"),
        "wgrad": (lambda: bwd([False, True, False])[1], lambda cfg: cr.conv3x3_rows_wgrad(dy, x, config=cfg),
                  "wgrad"),
        # with the prologue; the baseline: the compiled batch-norm + ReLU pass, then cuDNN
        "fprop_bn": (lambda: F.conv2d(bn_relu_c(x), wt, padding=1),
                     lambda cfg: cr.conv3x3_rows_fwd(x, wf, scale, shift, config=cfg), "fwd"),
        "wgrad_bn": (lambda: cudnn_wgrad(bn_relu_c(x)),
                     lambda cfg: cr.conv3x3_rows_wgrad(dy, x, scale, shift, config=cfg), "wgrad"),
    }
    unfused = {   # the pass, then our plain kernel with the table's configuration
        "fprop_bn": lambda: cr.conv3x3_rows_fwd(bn_relu_c(x), wf, config=plain["fprop"]),
        "wgrad_bn": lambda: cr.conv3x3_rows_wgrad(dy, bn_relu_c(x), config=plain["wgrad"]),
    }
    nbytes = (x.numel() + dy.numel()) * x.element_size()
    res: dict[str, Any] = {"shape": dict(N=n, C=c, K=k, H=h, W=w), "bound_us": nbytes / peak_bw * 1e6, "ops": {}}
    t0 = time.perf_counter()
    for op in ops:
        cudnn_fn, rows_fn, kname = plans[op]
        entry: dict[str, Any] = {"table": cr.CONFIGS.get((op.split("_")[0], 0, c, k, h, w)), "configs": []}
        res["ops"][op] = entry
        ref = cudnn_fn()
        if device == "cuda":
            entry["cudnn_us"] = time_graph(cudnn_fn, rep_ms)
            if op in unfused and plain[op.split("_")[0]] is not None:
                entry["unfused_rows_us"] = time_graph(unfused[op], rep_ms)
        table = cr.CONFIGS.get((op.split("_")[0], n, c, k, h, w)) or entry["table"]
        for cfg in ([table] if table else []) if table_only else candidate_configs(c, k, h, w, op.split("_")[0], tiny):
            row: dict[str, Any] = {"config": cfg}
            try:
                t1 = time.perf_counter()
                out = rows_fn(cfg)
                if device == "cuda":
                    torch.cuda.synchronize()
                row["first_call_s"] = round(time.perf_counter() - t1, 2)
                row["rel_err"] = _errors(out, ref)
                row.update(cr.kernel_info(kname))
                if device == "cuda":
                    row["us"] = time_graph(lambda: rows_fn(cfg), rep_ms)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:400]
                row["resources"] = type(e).__name__ == "OutOfResources"
            entry["configs"].append(row)
        timed = [r for r in entry["configs"] if "us" in r and r["rel_err"] <= REL_ERR_FLAG]
        if timed:
            entry["best"] = min(timed, key=lambda r: r["us"])
        if op == "wgrad" and device == "cuda" and table:   # its partial sums' reduction: torch's and ours
            imgs, rows, _, _ = cr._resolve(table, cr.DEFAULT_WGRAD, h, w, k)
            part = torch.randn(math.ceil(n / imgs) * (h // rows), k, 9, c, device=device, generator=g)
            entry["partials"] = {"shape": list(part.shape), "torch_sum_us": time_graph(lambda: part.sum(dim=0), rep_ms),
                                 "ours_us": time_graph(lambda: cr._sum_partials(part), rep_ms)}
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"\n{'shape':<22} {'op':<8} {'bound':>6} {'cuDNN':>7} {'best':>7} {'table':>7} {'cuDNN/best':>10} "
          f"{'of bound':>8}  best config")
    for r in results:
        s = r["shape"]
        label = f"N{s['N']} C{s['C']} K{s['K']} {s['H']}x{s['W']}"
        for op, e in r.get("ops", {}).items():
            best = e.get("best", {})
            cu, bu = e.get("cudnn_us"), best.get("us")
            table = next((c.get("us") for c in e["configs"] if e["table"] and c["config"] == e["table"]), None)
            fmt = lambda v: f"{v:7.1f}" if v else "      -"  # noqa: E731
            ratio = f"{cu / bu:10.2f}" if cu and bu else "         -"
            frac = f"{r['bound_us'] / bu:8.0%}" if bu else "       -"
            print(f"{label:<22} {op:<8} {r['bound_us']:6.1f} {fmt(cu)} {fmt(bu)} {fmt(table)} {ratio} {frac}  "
                  f"{best.get('config', '')}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"   # read when the kernels are decorated, i.e. imported
    import torch
    import triton

    if args.device == "cuda":
        from gpu_required import require_gpu   # this folder: on sys.path when run as a script

        require_gpu("conv_rows_bench.py", "--device cpu --tiny is the interpreter smoke test")
    on_gpu = args.device == "cuda"
    shapes = TINY_SHAPES if args.tiny else [WRN_SHAPES[int(i)] for i in args.shapes.split(",")]
    dtype = torch.bfloat16 if on_gpu else torch.float32
    name = torch.cuda.get_device_name() if on_gpu else "cpu (Triton interpreter)"
    peak_bw = next((bw for key, bw in PEAK_BW.items() if key in name), 3.35e12)
    if on_gpu:
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.benchmark_limit = 0   # as the trainer sets it: cuDNN at its best
    report: dict[str, Any] = {
        "device": name, "torch": torch.__version__, "triton": triton.__version__,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "dtype": str(dtype),
        "peak_bw_bytes_per_s": peak_bw, "timing": "CUDA-graph replay, do_bench median, L2 flushed",
        "args": vars(args) | {"out": str(args.out)}, "results": [],
    }
    for shape in shapes:
        ops = args.ops.split(",") if shape[0] >= 512 or args.tiny else args.teacher_ops.split(",")
        ops = [op for op in ops if shape[1] >= 4 or op in IMAGE_OPS]
        try:
            r = run_shape(shape, args.device, dtype, peak_bw, ops, args.tiny, args.rep_ms, args.table_only)
        except Exception as e:
            r = {"shape": dict(zip("NCKHW", shape)), "error": f"{type(e).__name__}: {e}",
                 "traceback": traceback.format_exc(limit=6)[-3000:]}
        report["results"].append(r)
        print(f"shape {shape} done in {r.get('seconds', '?')} s", flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1, default=str))
    print(f"\n{name}, torch {torch.__version__}, triton {triton.__version__}")
    print_table([r for r in report["results"] if "ops" in r])
    bad = [r for r in report["results"] if "error" in r] + [
        cfg for r in report["results"] for e in r.get("ops", {}).values() for cfg in e["configs"]
        if ("error" in cfg and not cfg.get("resources")) or cfg.get("rel_err", 0) > REL_ERR_FLAG]
    for b in bad[:10]:
        print("failed:", {key: b[key] for key in ("config", "shape", "error", "rel_err") if key in b})
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
