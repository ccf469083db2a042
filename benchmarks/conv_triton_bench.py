"""Triton 3x3 convolutions (trainables/conv_triton.py) against cuDNN on WRN-28-2's shapes.

For each shape (bf16, channels_last, stride 1, padding 1) it checks the Triton result against
cuDNN and a float32 reference and times each pair as a CUDA graph replayed under
triton.testing.do_bench (median; L2 flushed before every run; the plain eager time is kept as
``eager_us``: Python and launch overhead can exceed these 20-100 us kernels):

    fprop            F.conv2d                                  vs conv3x3_fwd
    dgrad            convolution_backward, mask [T, F, F]      vs conv3x3_dgrad (fwd kernel)
    wgrad            convolution_backward, mask [F, T, F]      vs conv3x3_wgrad
    fprop_prologue   compiled relu(x*scale+shift), F.conv2d    vs conv3x3_fwd(x, w, scale, shift)
    wgrad_prologue   compiled relu(x*scale+shift), wgrad       vs conv3x3_wgrad(dy, x, scale, shift)
    fprop_prologue_stats
                     the fprop_prologue pair, then the
                     per-channel sum / sum of squares of y     vs conv3x3_fwd(..., return_stats=True)

with the memory-bound time of each (bytes that must move / peak bandwidth: the fused op's
bytes; the unfused baseline also writes and re-reads the activation, reported as
``bound_unfused_us``). Triton kernels are timed on weights packed once (``pack_weight``; a
training step fuses that into the weight's bf16 cast); the packing time is reported apart.

    python benchmarks/conv_triton_bench.py --out results.json          # H100: ~75 s, cold caches
    python benchmarks/conv_triton_bench.py --sweep --shapes 0,1,2      # every tile config, ~3 min
    python benchmarks/conv_triton_bench.py --device cpu --tiny         # interpreter smoke test

Exit status 1 when any pair failed or was flagged (relative error over 2e-2).

One shape or pair failing is recorded in the JSON (its error) and the run goes on; the JSON is
rewritten after every shape, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

# Peak HBM bandwidth by device name (vendors' datasheets, SXM parts); 3.35e12 when unknown.
PEAK_BW = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}
REL_ERR_FLAG = 2e-2

WRN_SHAPES = [  # (N, C, K, H, W)
    (512, 32, 32, 32, 32), (512, 64, 64, 16, 16), (512, 128, 128, 8, 8),
    (256, 32, 32, 32, 32), (256, 64, 64, 16, 16), (256, 128, 128, 8, 8),
]
TINY_SHAPES = [(2, 16, 32, 6, 6), (1, 32, 16, 5, 7), (2, 48, 48, 4, 4)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu runs the kernels in Triton's interpreter (correctness only)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (float32 on cpu)")
    p.add_argument("--shapes", default=None,
                   help="comma-separated subset of shape indices (0-5: N=512 C=32,64,128, then N=256)")
    p.add_argument("--rep-ms", type=float, default=60.0, help="do_bench rep time per measurement")
    p.add_argument("--sweep", action="store_true",
                   help="time every candidate tile configuration of fwd and wgrad instead")
    p.add_argument("--no-compile", action="store_true",
                   help="eager (not torch.compile) batch-norm + ReLU baseline")
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------


def _errors(out, ref) -> dict[str, float]:
    """max |out - ref| and that over max |ref| (both in float32)."""
    out, ref = out.float(), ref.float()
    max_abs = (out - ref).abs().max().item()
    scale = ref.abs().max().item()
    return {"max_abs": max_abs, "rel": max_abs / scale if scale > 0 else float(max_abs > 0)}


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class Bench:
    """Times callables on the GPU: each is captured once in a CUDA graph and the graph's replay
    is timed with triton.testing.do_bench (L2 flushed before every run; median and 20th/80th
    percentiles, in us), so the Python and launch overhead of the callable (argument checks,
    the autotuner's dispatch, torch.compile's guards) is not counted: in a training step
    compiled with CUDA graphs it is not paid either. ``eager`` adds the plain do_bench time of
    the callable itself. Falls back to eager timing (with ``graph_error``) if capture fails."""

    def __init__(self, enabled: bool, rep_ms: float, eager: bool = True):
        self.enabled, self.rep_ms, self.eager = enabled, rep_ms, eager

    def _do_bench(self, fn: Callable[[], Any]) -> list[float]:
        import triton.testing
        return triton.testing.do_bench(fn, warmup=max(5, int(self.rep_ms / 4)), rep=int(self.rep_ms),
                                       quantiles=[0.5, 0.2, 0.8])

    def __call__(self, fn: Callable[[], Any]) -> dict[str, Any] | None:
        if not self.enabled:
            return None
        import torch
        out: dict[str, Any] = {}
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            q = self._do_bench(graph.replay)
            del graph
        except Exception as e:  # capture can fail; time eagerly then
            out["graph_error"] = f"{type(e).__name__}: {e}"[:300]
            torch.cuda.synchronize()
            q = self._do_bench(fn)
        out.update(us=q[0] * 1e3, p20_us=q[1] * 1e3, p80_us=q[2] * 1e3)
        if self.eager and "graph_error" not in out:
            out["eager_us"] = self._do_bench(fn)[0] * 1e3
        return out


def run_shape(shape: tuple[int, int, int, int, int], device: str, dtype, bench: Bench,
              peak_bw: float, compile_fn: Callable) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    import trainables.conv_triton as ct

    n, c, k, h, w = shape
    res: dict[str, Any] = {"shape": dict(N=n, C=c, K=k, H=h, W=w), "ops": {}}
    g = torch.Generator(device=device).manual_seed(0)
    cl = torch.channels_last
    x = torch.randn(n, c, h, w, device=device, generator=g).to(dtype).contiguous(memory_format=cl)
    dy = torch.randn(n, k, h, w, device=device, generator=g).to(dtype).contiguous(memory_format=cl)
    wt = (torch.randn(k, c, 3, 3, device=device, generator=g) / math.sqrt(9 * c)).to(dtype)
    wt = wt.contiguous(memory_format=cl)   # as a channels_last model holds it
    scale = 1.0 + 0.2 * torch.randn(c, device=device, generator=g)
    shift = 0.2 * torch.randn(c, device=device, generator=g)
    y_like = torch.empty(n, k, h, w, device=device, dtype=dtype)
    dw_f32 = torch.empty(k, c, 3, 3, device=device)

    def bn_relu(t, s, b):
        return torch.relu(t.float() * s.view(1, -1, 1, 1) + b.view(1, -1, 1, 1)).to(t.dtype)

    def channel_stats(t):
        tf = t.float()
        return tf.sum(dim=(0, 2, 3)), (tf * tf).sum(dim=(0, 2, 3))

    bn_relu_c, stats_c = compile_fn(bn_relu), compile_fn(channel_stats)

    def cudnn_dgrad(d, inp, wgt):
        return torch.ops.aten.convolution_backward(d, inp, wgt, None, [1, 1], [1, 1], [1, 1], False,
                                                   [0, 0], 1, [True, False, False])[0]

    def cudnn_wgrad(d, inp, wgt):
        return torch.ops.aten.convolution_backward(d, inp, wgt, None, [1, 1], [1, 1], [1, 1], False,
                                                   [0, 0], 1, [False, True, False])[1]

    def fp32_fwd(inp, wgt):
        return F.conv2d(inp.float(), wgt.float(), padding=1)

    t0 = time.perf_counter()
    wp = ct.pack_weight(wt, dtype)
    wpd = ct.pack_weight(wt, dtype, for_dgrad=True)
    res["pack_weight"] = bench(lambda: ct.pack_weight(wt, dtype))

    act_in, act_out = _nbytes(x), _nbytes(y_like)
    # name: (cudnn fn, triton fn, bytes of the fused op, extra bytes of the unfused baseline,
    #        fp32 reference fn or None, how to compare outputs)
    ops = {
        "fprop": (lambda: F.conv2d(x, wt, padding=1),
                  lambda: ct.conv3x3_fwd_packed(x, wp),
                  act_in + act_out + _nbytes(wp), 0,
                  lambda: fp32_fwd(x, wt)),
        "dgrad": (lambda: cudnn_dgrad(dy, x, wt),
                  lambda: ct.conv3x3_fwd_packed(dy, wpd),
                  act_out + act_in + _nbytes(wpd), 0,
                  lambda: cudnn_dgrad(dy.float(), x.float(), wt.float())),
        "wgrad": (lambda: cudnn_wgrad(dy, x, wt),
                  lambda: ct.conv3x3_wgrad(dy, x),
                  act_out + act_in + _nbytes(dw_f32), 0,
                  lambda: cudnn_wgrad(dy.float(), x.float(), wt.float())),
        "fprop_prologue": (lambda: F.conv2d(bn_relu_c(x, scale, shift), wt, padding=1),
                           lambda: ct.conv3x3_fwd_packed(x, wp, scale, shift),
                           act_in + act_out + _nbytes(wp), 2 * act_in,
                           lambda: fp32_fwd(bn_relu(x, scale, shift), wt)),
        "wgrad_prologue": (lambda: cudnn_wgrad(dy, bn_relu_c(x, scale, shift), wt),
                           lambda: ct.conv3x3_wgrad(dy, x, scale, shift),
                           act_out + act_in + _nbytes(dw_f32), 2 * act_in,
                           lambda: cudnn_wgrad(dy.float(), bn_relu(x, scale, shift).float(), wt.float())),
        "fprop_prologue_stats": (
            lambda: (lambda y: (y, *stats_c(y)))(F.conv2d(bn_relu_c(x, scale, shift), wt, padding=1)),
            lambda: ct.conv3x3_fwd_packed(x, wp, scale, shift, return_stats=True),
            act_in + act_out + _nbytes(wp), 2 * act_in + act_out,
            None),
    }
    for name, (ref_fn, tri_fn, nbytes, extra, fp32_fn) in ops.items():
        entry: dict[str, Any] = {"bytes": nbytes, "bound_us": nbytes / peak_bw * 1e6}
        if extra:
            entry["bound_unfused_us"] = (nbytes + extra) / peak_bw * 1e6
        res["ops"][name] = entry
        try:
            t1 = time.perf_counter()
            out_t = tri_fn()
            if device == "cuda":
                torch.cuda.synchronize()
            entry["first_call_s"] = round(time.perf_counter() - t1, 3)   # compile + autotune
            entry["kernel"] = ct.last_kernel_info("wgrad" if "wgrad" in name else "fwd")
            out_r = ref_fn()
            if name == "fprop_prologue_stats":
                y_t, s_t, ss_t = out_t
                y_r, s_r, ss_r = out_r
                entry["err_vs_cudnn"] = _errors(y_t, y_r)
                own_s, own_ss = channel_stats(y_t)
                entry["err_sum_vs_own_y"] = _errors(s_t, own_s)
                entry["err_sumsq_vs_own_y"] = _errors(ss_t, own_ss)
                entry["err_sum_vs_cudnn_y"] = _errors(s_t, s_r)
                entry["err_sumsq_vs_cudnn_y"] = _errors(ss_t, ss_r)
                worst = max(entry["err_vs_cudnn"]["rel"], entry["err_sum_vs_own_y"]["rel"],
                            entry["err_sumsq_vs_own_y"]["rel"])
            else:
                entry["err_vs_cudnn"] = _errors(out_t, out_r)
                worst = entry["err_vs_cudnn"]["rel"]
                if fp32_fn is not None:
                    ref32 = fp32_fn()
                    entry["err_vs_fp32"] = _errors(out_t, ref32)
                    entry["cudnn_err_vs_fp32"] = _errors(out_r, ref32)
            entry["flag"] = bool(worst > REL_ERR_FLAG or not math.isfinite(worst))
            del out_t, out_r
            tc, tt = bench(ref_fn), bench(tri_fn)
            if tc and tt:
                entry["cudnn"], entry["triton"] = tc, tt
                entry["speedup"] = tc["us"] / tt["us"]
                entry["cudnn_frac_of_bound"] = entry["bound_us"] / tc["us"]
                entry["triton_frac_of_bound"] = entry["bound_us"] / tt["us"]
        except Exception as e:  # one pair failing must not end the run
            entry["error"] = f"{type(e).__name__}: {e}"
            entry["traceback"] = traceback.format_exc(limit=6)[-3000:]
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def fwd_sweep_configs(c: int, k: int) -> list[dict[str, int]]:
    """Forward tile configurations to time one by one (``--sweep``)."""
    out = [dict(BLOCK_M=bm, num_warps=w, num_stages=st) for bm, w, st in
           ((64, 4, 3), (128, 4, 3), (128, 4, 4), (128, 8, 3), (256, 4, 3),
            (64, 4, 1), (128, 4, 1), (128, 8, 1), (256, 8, 1), (128, 4, 2), (128, 8, 2))]
    out += [dict(BLOCK_M=bm, num_warps=w, num_stages=st, CACHE=cm) for bm, w, st, cm in
            ((128, 4, 3, ".ca"), (128, 8, 3, ".ca"), (128, 4, 1, ".ca"), (128, 4, 1, ".cg"),
             (128, 4, 3, ".cg"))]
    for bk in (32, 64, 128):
        if bk <= c and c % bk == 0 and bk != min(c, 64):
            out += [dict(BLOCK_M=bm, num_warps=w, num_stages=3, BLOCK_K=bk) for bm, w in ((128, 4), (128, 8))]
    if k >= 128:
        out += [dict(BLOCK_M=bm, num_warps=w, num_stages=3, BLOCK_N=64) for bm, w in ((64, 4), (128, 4), (128, 8))]
    return out


def wgrad_sweep_configs(c: int, k: int) -> list[dict[str, int]]:
    """wgrad configurations to time one by one (``--sweep``): tap groups, tiles, split, atomics."""
    bc, bko = min(c, 128), min(k, 128)
    out = []
    feasible = [t for t in (9, 3, 1) if t * bc * bko / (32 * 8) <= 128][:2]
    for taps in feasible:
        for bm, w in ((32, 4), (64, 4), (64, 8), (128, 8)):
            if taps * bc * bko / (32 * w) <= 128:
                for st in (1, 2):
                    out.append(dict(BLOCK_M=bm, TAPS=taps, SPLIT=2, num_warps=w, num_stages=st))
    first = dict(out[0]) if out else dict(BLOCK_M=64, TAPS=1, SPLIT=2, num_warps=8, num_stages=2)
    out += [first | dict(SPLIT=1), first | dict(SPLIT=4), first | dict(ATOMIC=False),
            first | dict(CACHE=".ca"), first | dict(num_stages=3, CACHE=".ca")]
    if c >= 128:
        out += [dict(BLOCK_M=64, TAPS=3, SPLIT=2, num_warps=8, num_stages=2, BLOCK_C=64),
                dict(BLOCK_M=64, TAPS=3, SPLIT=2, num_warps=8, num_stages=2, BLOCK_C=64, BLOCK_KO=64),
                dict(BLOCK_M=64, TAPS=9, SPLIT=2, num_warps=8, num_stages=2, BLOCK_C=32, BLOCK_KO=64)]
    return out


def run_sweep(shape: tuple[int, int, int, int, int], device: str, dtype, bench: Bench,
              peak_bw: float) -> dict[str, Any]:
    """Time every sweep configuration of fwd / wgrad (with and without the prologue) on one shape."""
    import torch
    import torch.nn.functional as F
    import trainables.conv_triton as ct

    n, c, k, h, w = shape
    cl = torch.channels_last
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, c, h, w, device=device, generator=g).to(dtype).contiguous(memory_format=cl)
    dy = torch.randn(n, k, h, w, device=device, generator=g).to(dtype).contiguous(memory_format=cl)
    wt = (torch.randn(k, c, 3, 3, device=device, generator=g) / math.sqrt(9 * c)).to(dtype)
    scale = 1.0 + 0.2 * torch.randn(c, device=device, generator=g)
    shift = 0.2 * torch.randn(c, device=device, generator=g)
    wp = ct.pack_weight(wt, dtype)
    a = torch.relu(x.float() * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1)).to(dtype)

    def wgrad_ref(inp):
        return torch.ops.aten.convolution_backward(dy, inp, wt, None, [1, 1], [1, 1], [1, 1], False,
                                                   [0, 0], 1, [False, True, False])[1]

    nbytes = _nbytes(x) + _nbytes(dy)
    res: dict[str, Any] = {"shape": dict(N=n, C=c, K=k, H=h, W=w), "bound_us": nbytes / peak_bw * 1e6,
                           "sweep": {}}
    plans = {
        "fwd": (fwd_sweep_configs(c, k), lambda cfg: ct.conv3x3_fwd_packed(x, wp, config=cfg),
                F.conv2d(x, wt, padding=1), "fwd"),
        "fwd_prologue": (fwd_sweep_configs(c, k),
                         lambda cfg: ct.conv3x3_fwd_packed(x, wp, scale, shift, config=cfg),
                         F.conv2d(a, wt, padding=1), "fwd"),
        "wgrad": (wgrad_sweep_configs(c, k), lambda cfg: ct.conv3x3_wgrad(dy, x, config=cfg),
                  wgrad_ref(x), "wgrad"),
        "wgrad_prologue": (wgrad_sweep_configs(c, k),
                           lambda cfg: ct.conv3x3_wgrad(dy, x, scale, shift, config=cfg),
                           wgrad_ref(a), "wgrad"),
    }
    for op, (configs, fn, ref, kname) in plans.items():
        rows = []
        for cfg in configs:
            row: dict[str, Any] = {"config": cfg}
            try:
                out = fn(cfg)
                row["rel_err"] = _errors(out, ref)["rel"]
                row["kernel"] = ct.last_kernel_info(kname)
                t = bench(lambda: fn(cfg))
                if t:
                    row["us"] = t["us"]
                    row["frac_of_bound"] = res["bound_us"] / t["us"]
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
        res["sweep"][op] = rows
    return res


def print_sweep(results: list[dict[str, Any]]) -> None:
    for r in results:
        s = r.get("shape", {})
        print(f"\nsweep N{s.get('N')} {s.get('H')}x{s.get('W')} C{s.get('C')} K{s.get('K')}  "
              f"(bound {r.get('bound_us', 0):.1f} us)")
        for op, rows in r.get("sweep", {}).items():
            for row in sorted(rows, key=lambda q: q.get("us", 1e9)):
                cfg = " ".join(f"{key}={v}" for key, v in row["config"].items())
                if "error" in row:
                    print(f"  {op:<15} {cfg:<70} ERROR {row['error'][:60]}")
                    continue
                kinfo = row.get("kernel", {})
                print(f"  {op:<15} {cfg:<70} {row.get('us', float('nan')):8.1f} us  "
                      f"rel {row.get('rel_err', float('nan')):.1e}  regs {kinfo.get('n_regs')} "
                      f"spills {kinfo.get('n_spills')} wgmma {kinfo.get('wgmma')}")


def print_table(results: list[dict[str, Any]]) -> None:
    head = (f"{'shape':<22}{'op':<22}{'cuDNN us':>10}{'Triton us':>11}{'speedup':>9}{'bound us':>10}"
            f"{'cuDNN %bd':>10}{'Tri %bd':>9}{'rel err':>10}  note")
    print(head)
    print("-" * len(head))
    for r in results:
        s = r.get("shape", {})
        label = f"N{s.get('N')} {s.get('H')}x{s.get('W')} C{s.get('C')} K{s.get('K')}"
        if "error" in r:
            print(f"{label:<22}{'(shape failed)':<22} {r['error'][:80]}")
            continue
        for name, e in r["ops"].items():
            if "error" in e:
                print(f"{label:<22}{name:<22} ERROR {e['error'][:90]}")
                continue
            cu, tr = e.get("cudnn", {}).get("us"), e.get("triton", {}).get("us")
            fmt = (lambda v, w, p=1: f"{v:>{w}.{p}f}" if v is not None else f"{'-':>{w}}")
            pct = (lambda v: f"{100 * v:>8.0f}%" if v is not None else f"{'-':>9}")
            rel = e.get("err_vs_cudnn", {}).get("rel")
            rel_s = f"{rel:>10.1e}" if rel is not None else f"{'-':>10}"
            note = "REL ERR > 2e-2" if e.get("flag") else ""
            if "bound_unfused_us" in e:
                note = (note + f" unfused bound {e['bound_unfused_us']:.1f}us").strip()
            print(f"{label:<22}{name:<22}{fmt(cu, 10)}{fmt(tr, 11)}{fmt(e.get('speedup'), 9, 2)}"
                  f"{fmt(e['bound_us'], 10)}{pct(e.get('cudnn_frac_of_bound'))}"
                  f"{pct(e.get('triton_frac_of_bound'))}{rel_s}  {note}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        # Read when the kernels are decorated, i.e. when conv_triton is imported: set it first.
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch
    import triton
    import trainables.conv_triton as ct

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --tiny for the interpreter smoke test", file=sys.stderr)
        return 2
    on_gpu = args.device == "cuda"
    shapes = TINY_SHAPES if args.tiny else WRN_SHAPES
    if args.shapes:
        shapes = [shapes[int(i)] for i in args.shapes.split(",")]
    dtype = torch.bfloat16 if on_gpu else torch.float32
    name = torch.cuda.get_device_name() if on_gpu else "cpu (Triton interpreter)"
    peak_bw = next((bw for key, bw in PEAK_BW.items() if key in name), 3.35e12)
    if on_gpu:
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.allow_tf32 = False      # the float32 references are true float32
        torch.backends.cuda.matmul.allow_tf32 = False
    compile_fn = (lambda f: f) if (args.no_compile or not on_gpu) else (
        lambda f: torch.compile(f, dynamic=False))
    bench = Bench(on_gpu, args.rep_ms)

    report: dict[str, Any] = {
        "device": name, "torch": torch.__version__, "triton": triton.__version__,
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if on_gpu else None,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "dtype": str(dtype), "peak_bw_bytes_per_s": peak_bw, "rel_err_flag": REL_ERR_FLAG,
        "interpreter": ct.INTERPRET, "timing": "triton.testing.do_bench median, L2 flushed" if on_gpu else None,
        "baseline_compiled": not args.no_compile and on_gpu, "args": vars(args) | {"out": str(args.out)},
        "results": [],
    }
    t_start = time.perf_counter()

    def save() -> None:
        report["total_s"] = round(time.perf_counter() - t_start, 1)
        try:
            report["tuned_configs"] = ct.tuned_configs()
        except Exception as e:  # reporting must not end the run
            report["tuned_configs"] = f"unavailable: {e}"
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1, default=str))

    for shape in shapes:
        try:
            if args.sweep:
                r = run_sweep(shape, args.device, dtype, Bench(on_gpu, args.rep_ms, eager=False), peak_bw)
            else:
                r = run_shape(shape, args.device, dtype, bench, peak_bw, compile_fn)
        except Exception as e:
            r = {"shape": dict(zip("NCKHW", shape)), "error": f"{type(e).__name__}: {e}",
                 "traceback": traceback.format_exc(limit=6)[-3000:]}
        report["results"].append(r)
        print(f"shape {shape} done in {r.get('seconds', '?')} s", flush=True)
        save()

    print(f"\n{name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"bound at {peak_bw / 1e12:.2f} TB/s, total {time.perf_counter() - t_start:.0f} s")
    if args.sweep:
        print_sweep(report["results"])
        save()
        return 0
    print_table(report["results"])
    save()
    n_err = sum(1 for r in report["results"] if "error" in r) + sum(
        1 for r in report["results"] for e in r.get("ops", {}).values() if "error" in e)
    n_flag = sum(1 for r in report["results"] for e in r.get("ops", {}).values() if e.get("flag"))
    print(f"\n{n_err} errors, {n_flag} flagged (rel err > {REL_ERR_FLAG})"
          + (f"; JSON in {args.out}" if args.out else ""))
    return 1 if n_err or n_flag else 0


if __name__ == "__main__":
    sys.exit(main())
