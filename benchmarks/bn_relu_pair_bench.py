"""The paired inner batch norms' backward kernels (trainables/fast/bn_relu_pair.py) against Inductor's, at the
shake-shake WRN-26 96x2d step's shapes.

For each stage's shape (512 images in two segments, bf16, channels_last: 2 x 96 channels at 32x32, 2 x 192 at 16x16,
2 x 384 at 8x8) it times, each captured in a CUDA graph and replayed by triton.testing.do_bench (median, L2 flushed):

- ``inductor``: the two batch norms' backward as the model runs it today, compiled by Inductor: each branch's mask from
  its ReLU's output, the two sums and the input gradient written into the stacked channels;
- ``ours``: ``cowtune::bn_relu_pair_backward`` (sums, coefficients, apply), under each launch setting of the sweep
  (pixels a program loads at a time, the sums kernel's least number of programs, which sets the pixels each adds up,
  and warps; settings that launch alike are timed once), each checked against the PyTorch formula.

It prints microseconds, the bytes each reads and writes, and TB/s, and the fastest setting per shape; the module's
constants (``BLOCK_PIXELS``, ``MIN_PROGRAMS``, ``NUM_WARPS``, and ``CHUNK_PIXELS``, the most pixels a sums program adds
up) are what the step uses.

    python benchmarks/bn_relu_pair_bench.py --out results.json       # a GPU: about a minute
    python benchmarks/bn_relu_pair_bench.py --device cpu --tiny      # interpreter smoke test, no timing

Exit status 1 when a setting's gradients disagree with the formula's.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from trainables.models.segmented_bn import segment_affine, segment_backward  # noqa: E402

SHAPES = [(512, 96, 32), (512, 192, 16), (512, 384, 8)]   # (N, C per branch, H = W)
TINY_SHAPES = [(4, 16, 4), (4, 24, 2)]
SWEEP = {"BLOCK_PIXELS": (64, 128, 256), "MIN_PROGRAMS": (256, 1024, 4096), "NUM_WARPS": (4, 8)}
SEGMENTS, EPS = 2, 1e-5


def inputs(n: int, c: int, hw: int, device: str, dtype: torch.dtype, seed: int = 0):
    """(dha, dhb, y, mean, var, weight, bias) and the ReLU outputs (ha, hb) of the forward pass."""
    g = torch.Generator(device=device).manual_seed(seed)

    def cl(t):
        return t.to(dtype).contiguous(memory_format=torch.channels_last)

    y = cl(torch.randn(n, 2 * c, hw, hw, generator=g, device=device) * 2 + 0.5)
    dha, dhb = (cl(torch.randn(n, c, hw, hw, generator=g, device=device)) for _ in range(2))
    var, mean = torch.var_mean(y.float().unflatten(0, (SEGMENTS, -1)), dim=(1, 3, 4), correction=0)
    weight, bias = torch.randn(2 * c, generator=g, device=device), torch.randn(2 * c, generator=g, device=device)
    view = (SEGMENTS, 1, -1, 1, 1)
    _, scale, shift = segment_affine(mean.view(view), var.view(view), weight, bias, EPS)
    h = torch.relu(y.float().unflatten(0, (SEGMENTS, -1)) * scale + shift).flatten(0, 1)
    ha, hb = cl(h[:, :c]), cl(h[:, c:])
    return (dha, dhb, y, mean, var, weight, bias), (ha, hb)


def inductor_backward(dha, dhb, y, ha, hb, mean, var, weight, bias):
    """The two batch norms' backward as the unpaired model computes it: the mask from each ReLU's output."""
    c = dha.shape[1]
    view = (SEGMENTS, 1, c, 1, 1)
    outs, dws, dbs = [], [], []
    for d, h, lo in ((dha, ha, 0), (dhb, hb, c)):
        m = mean[:, lo:lo + c].view(view)
        rstd, scale, shift = segment_affine(m, var[:, lo:lo + c].view(view), weight[lo:lo + c], bias[lo:lo + c], EPS)
        dx, dw, db = segment_backward(torch.where(h > 0, d, 0).unflatten(0, (SEGMENTS, -1)).float(),
                                      y[:, lo:lo + c].unflatten(0, (SEGMENTS, -1)).float(), m, rstd, scale, shift,
                                      relu=False)
        outs.append(dx.to(y.dtype).flatten(0, 1))
        dws.append(dw)
        dbs.append(db)
    return torch.cat(outs, 1), torch.cat(dws), torch.cat(dbs)


def rel_errors(got, want) -> list[float]:
    return [((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu runs the kernels in Triton's interpreter (correctness only, no timing)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes")
    p.add_argument("--rep-ms", type=float, default=100.0, help="do_bench's repetition time per setting")
    args = p.parse_args(argv)
    if args.device == "cpu":
        if not args.tiny:
            p.error("--device cpu runs the kernels in Triton's interpreter: add --tiny")
        os.environ["TRITON_INTERPRET"] = "1"   # before bn_relu_pair is imported
    else:
        from gpu_required import require_gpu

        require_gpu("bn_relu_pair_bench.py")
    from conv_rows_bench import PEAK_BW, time_graph
    from trainables.fast import bn_relu_pair as brp

    timed = args.device == "cuda"
    name = torch.cuda.get_device_name() if timed else "cpu (Triton's interpreter)"
    peak = next((bw for key, bw in PEAK_BW.items() if key in name), 3.35e12)
    print(f"# paired inner batch norms' backward on {name}, torch {torch.__version__}")
    dtype = torch.bfloat16
    defaults = {key: getattr(brp, key) for key in (*SWEEP, "CHUNK_PIXELS")}
    settings = [dict(zip(SWEEP, values)) for values in itertools.product(*SWEEP.values())] if timed else [defaults]
    results, ok = [], True
    for n, c, hw in TINY_SHAPES if args.tiny else SHAPES:
        args_, (ha, hb) = inputs(n, c, hw, args.device, dtype)
        dha, dhb, y, mean, var, weight, bias = args_
        want = brp._reference_backward(*[a.double() for a in args_], EPS, SEGMENTS)
        act = y.numel() * y.element_size()   # one stacked activation's bytes
        row = {"shape": [n, c, hw], "ours": []}
        if timed:
            compiled = torch.compile(inductor_backward, dynamic=False)
            got = compiled(dha, dhb, y, ha, hb, mean, var, weight, bias)
            row["inductor_us"] = us = time_graph(lambda: compiled(dha, dhb, y, ha, hb, mean, var, weight, bias),
                                                 args.rep_ms)
            moved = 7 * act   # sums: dh, the ReLU outputs and y; applies: those again, and dy
            print(f"N={n} C=2x{c} {hw}x{hw}: inductor {us:8.1f} us  {moved / us / 1e6:.2f} TB/s "
                  f"({moved / 1e6:.0f} MB)  errors {', '.join(f'{e:.1e}' for e in rel_errors(got, want))}")
        plans = set()
        for setting in settings:
            for key, value in setting.items():
                setattr(brp, key, value)
            plan = brp.launch_plan(*y.shape, SEGMENTS)
            if (plan, setting["NUM_WARPS"]) in plans:   # another setting that launches the same way
                continue
            plans.add((plan, setting["NUM_WARPS"]))
            setting = {**setting, "chunk": plan[0], "block": plan[1]}
            got = brp.bn_relu_pair_backward(*args_, EPS, SEGMENTS)
            errs = rel_errors(got, want)
            good = errs[0] < 1e-2 and max(errs[1:]) < 1e-3
            ok &= good
            entry = {**setting, "errors": errs, "ok": good}
            if timed:
                entry["us"] = us = time_graph(lambda: brp.bn_relu_pair_backward(*args_, EPS, SEGMENTS), args.rep_ms)
                moved = 5 * act   # sums: dh and y; apply: those again, and dy
                print(f"  ours {setting}: {us:8.1f} us  {moved / us / 1e6:.2f} TB/s ({moved / 1e6:.0f} MB; "
                      f"{moved / peak * 1e6 / us:.0%} of {peak / 1e12:.2f})  {'OK' if good else 'WRONG'}")
            else:
                print(f"N={n} C=2x{c} {hw}x{hw}: ours {setting}: errors {', '.join(f'{e:.1e}' for e in errs)} "
                      f"{'OK' if good else 'WRONG'}")
            row["ours"].append(entry)
        for key, value in defaults.items():
            setattr(brp, key, value)
        if timed:
            best = min(row["ours"], key=lambda e: e["us"])
            print(f"  fastest: {best['us']:.1f} us ({ {k: best[k] for k in (*SWEEP, 'chunk', 'block')} }) against inductor's "
                  f"{row['inductor_us']:.1f} us")
        results.append(row)
    if args.out:
        args.out.write_text(json.dumps({"device": name, "torch": torch.__version__, "defaults": defaults,
                                        "results": results}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
