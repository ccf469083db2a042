"""Row-streaming 3x3 convolutions (trainables/conv_rows.py) against cuDNN and conv_triton's kernels.

For each shape (bf16, channels_last, stride 1, padding 1) and each op (fprop, dgrad, wgrad) it
times cuDNN, conv_triton's tap kernel (autotuned) and every candidate configuration of the row
kernel, each as a CUDA-graph replay with L2 flushed (``conv_triton_bench.Bench``), checks every
result against cuDNN, and prints the best row configuration per op with its fraction of the
memory bound (input + output bytes / peak bandwidth).

    python benchmarks/conv_rows_bench.py --out results.json       # H100: a few minutes
    python benchmarks/conv_rows_bench.py --device cpu --tiny      # interpreter smoke test

Exit status 1 when any configuration failed or disagreed with cuDNN (relative error over 2e-2).
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conv_triton_bench import PEAK_BW, REL_ERR_FLAG, WRN_SHAPES, Bench, _errors, _nbytes  # noqa: E402

TINY_SHAPES = [(3, 16, 32, 8, 8), (2, 32, 16, 4, 16)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu runs the kernels in Triton's interpreter (correctness only)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (float32 on cpu)")
    p.add_argument("--shapes", default="0,1,2",
                   help="comma-separated shape indices (0-5: N=512 C=32,64,128, then N=256)")
    p.add_argument("--rep-ms", type=float, default=40.0, help="do_bench rep time per measurement")
    p.add_argument("--ops", default="fprop,dgrad,wgrad")
    return p.parse_args(argv)


def row_configs(h: int, w: int, op: str, tiny: bool) -> list[dict[str, int]]:
    """Candidate configurations: pixels per GEMM tile, row bands per image, warps, stages."""
    if tiny:
        return [{"BM": max(16, w), "SEGS": s} for s in (1, 2) if h % s == 0]
    stages, bands = ((1, 2), (1, 2)) if op == "wgrad" else ((2,), (1, 2, 4))
    out = []
    for bm, segs, warps, st in itertools.product((64, 128), bands, (4, 8), stages):
        if bm % w == 0 and h % segs == 0 and h // segs >= 4:
            out.append({"BM": bm, "SEGS": segs, "num_warps": warps, "num_stages": st})
    return out


def run_shape(shape, device, dtype, bench: Bench, peak_bw: float, ops: list[str], tiny: bool) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    import trainables.conv_rows as cr
    import trainables.conv_triton as ct

    n, c, k, h, w = shape
    cl = torch.channels_last
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, c, h, w, device=device, generator=g).to(dtype).contiguous(memory_format=cl)
    dy = torch.randn(n, k, h, w, device=device, generator=g).to(dtype).contiguous(memory_format=cl)
    wt = (torch.randn(k, c, 3, 3, device=device, generator=g) / math.sqrt(9 * c)).to(dtype)
    wt = wt.contiguous(memory_format=cl)
    wp, wpd = ct.pack_weight(wt, dtype), ct.pack_weight(wt, dtype, for_dgrad=True)

    def bwd(mask):
        return torch.ops.aten.convolution_backward(dy, x, wt, None, [1, 1], [1, 1], [1, 1], False,
                                                   [0, 0], 1, mask)

    plans = {
        "fprop": (lambda: F.conv2d(x, wt, padding=1), lambda: ct.conv3x3_fwd_packed(x, wp),
                  lambda cfg: cr.conv3x3_rows_fwd(x, wp, config=cfg), _nbytes(x) * (1 + k / c)),
        "dgrad": (lambda: bwd([True, False, False])[0], lambda: ct.conv3x3_fwd_packed(dy, wpd),
                  lambda cfg: cr.conv3x3_rows_fwd(dy, wpd, config=cfg), _nbytes(x) * (1 + k / c)),
        "wgrad": (lambda: bwd([False, True, False])[1], lambda: ct.conv3x3_wgrad(dy, x),
                  lambda cfg: cr.conv3x3_rows_wgrad(dy, x, config=cfg), _nbytes(x) * (1 + k / c)),
    }
    res: dict[str, Any] = {"shape": dict(N=n, C=c, K=k, H=h, W=w), "ops": {}}
    t0 = time.perf_counter()
    for op in ops:
        cudnn_fn, taps_fn, rows_fn, nbytes = plans[op]
        bound = nbytes / peak_bw * 1e6
        entry: dict[str, Any] = {"bound_us": bound, "configs": []}
        res["ops"][op] = entry
        ref = cudnn_fn()
        for name, fn in (("cudnn", cudnn_fn), ("taps", taps_fn)):
            try:
                out = fn()
                entry[name] = {"rel_err": _errors(out, ref)["rel"], **(bench(fn) or {})}
            except Exception as e:
                entry[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        for cfg in row_configs(h, w, op, tiny):
            row: dict[str, Any] = {"config": cfg}
            try:
                t1 = time.perf_counter()
                out = rows_fn(cfg)
                if device == "cuda":
                    torch.cuda.synchronize()
                row["first_call_s"] = round(time.perf_counter() - t1, 2)
                row["rel_err"] = _errors(out, ref)["rel"]
                kinfo = getattr(cr, "_LAST_KERNEL", {}).get("wgrad" if op == "wgrad" else "fwd")
                for attr in ("n_regs", "n_spills"):
                    if hasattr(kinfo, attr):
                        row[attr] = getattr(kinfo, attr)
                t = bench(lambda: rows_fn(cfg))
                if t:
                    row["us"] = t["us"]
                    row["frac_of_bound"] = bound / t["us"]
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:400]
            entry["configs"].append(row)
        timed = [r for r in entry["configs"] if "us" in r and r.get("rel_err", 1) <= REL_ERR_FLAG]
        if timed:
            entry["best"] = min(timed, key=lambda r: r["us"])
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"\n{'shape':<22} {'op':<6} {'bound':>7} {'cuDNN':>7} {'taps':>7} {'rows':>7} "
          f"{'rows/cuDNN':>10} {'of bound':>8}  best config")
    for r in results:
        s = r["shape"]
        label = f"N{s['N']} C{s['C']} K{s['K']} {s['H']}x{s['W']}"
        for op, e in r.get("ops", {}).items():
            best = e.get("best", {})
            cu, ta, ro = e.get("cudnn", {}).get("us"), e.get("taps", {}).get("us"), best.get("us")
            fmt = lambda v: f"{v:7.1f}" if v else "      -"  # noqa: E731
            ratio = f"{cu / ro:10.2f}" if cu and ro else "         -"
            frac = f"{best['frac_of_bound']:8.0%}" if "frac_of_bound" in best else "       -"
            print(f"{label:<22} {op:<6} {e['bound_us']:7.1f} {fmt(cu)} {fmt(ta)} {fmt(ro)} {ratio} {frac}  "
                  f"{best.get('config', '')}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"   # read when the kernels are decorated
    import torch
    import triton

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --tiny for the interpreter smoke test", file=sys.stderr)
        return 2
    on_gpu = args.device == "cuda"
    shapes = TINY_SHAPES if args.tiny else [WRN_SHAPES[int(i)] for i in args.shapes.split(",")]
    dtype = torch.bfloat16 if on_gpu else torch.float32
    name = torch.cuda.get_device_name() if on_gpu else "cpu (Triton interpreter)"
    peak_bw = next((bw for key, bw in PEAK_BW.items() if key in name), 3.35e12)
    if on_gpu:
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.benchmark_limit = 0   # as the trainer sets it
    ops = args.ops.split(",")
    report: dict[str, Any] = {
        "device": name, "torch": torch.__version__, "triton": triton.__version__,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "dtype": str(dtype),
        "peak_bw_bytes_per_s": peak_bw, "timing": "CUDA-graph replay, do_bench median, L2 flushed",
        "args": vars(args) | {"out": str(args.out)}, "results": [],
    }
    for shape in shapes:
        try:
            r = run_shape(shape, args.device, dtype, Bench(on_gpu, args.rep_ms, eager=False), peak_bw,
                          ops, args.tiny)
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
        if "error" in cfg or cfg.get("rel_err", 0) > REL_ERR_FLAG]
    for b in bad[:10]:
        print("failed:", {key: b[key] for key in ("config", "shape", "error", "rel_err") if key in b})
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
