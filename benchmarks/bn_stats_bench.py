"""Batch statistics per segment and channel: Inductor's ``var_mean`` against trainables/channel_stats.py.

For each shape of the shake-shake WRN-26's student (N=512 as two segments of 256, bf16, channels_last)
it times Inductor's compiled ``torch.var_mean`` as the one-pass batch norm calls it (untuned, and
with coordinate-descent tuning) and every candidate configuration of ``segment_stats``, each
captured in a CUDA graph (conv_rows_bench.time_graph: median replay, L2 flushed), checks each
result against float64, and prints the best per shape with its bandwidth and the sum over a step
(the number of batch norms of each shape in the model).

    python benchmarks/bn_stats_bench.py --out results.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = [  # (N, C, H, W, batch norms of this shape in the shake-shake WRN-26 96x2d's student)
    (512, 16, 32, 32, 1), (512, 96, 32, 32, 17), (512, 192, 16, 16, 17), (512, 384, 8, 8, 17),
]


def candidates(c: int, seg_rows: int, s: int) -> list[dict[str, int]]:
    out = []
    for block_c in (32, 64, 128):
        if block_c > max(c, 32) * 2:
            continue
        cblocks = -(-c // block_c)
        for tile, programs, warps, stages in itertools.product((2048, 4096, 8192), (264, 528, 1056, 2112), (4, 8),
                                                               (1, 3)):
            chunks = max(1, programs // (s * cblocks))
            if tile // block_c < 1 or seg_rows // chunks < tile // block_c:
                continue
            out.append({"BLOCK_M": tile // block_c, "BLOCK_C": block_c, "chunks": chunks, "num_warps": warps,
                        "STAGES": stages})
    return out


def main(argv: list[str] | None = None) -> int:
    import torch
    from conv_rows_bench import time_graph
    from trainables.channel_stats import segment_stats

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--rep-ms", type=float, default=30.0)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    s = 2
    results = []

    def var_mean(x):
        var, mean = torch.var_mean(x.unflatten(0, (s, -1)).float(), dim=(1, 3, 4), correction=0)
        return mean.view(s, -1), var.view(s, -1)

    inductor = {"untuned": torch.compile(var_mean, dynamic=False),
                "tuned": torch.compile(var_mean, dynamic=False, options={"coordinate_descent_tuning": True})}
    for n, c, h, w, count in SHAPES:
        x = (torch.randn(n, c, h, w, device="cuda") * 2 + 0.5).to(torch.bfloat16).to(memory_format=torch.channels_last)
        var_ref, mean_ref = torch.var_mean(x.double().unflatten(0, (s, -1)), dim=(1, 3, 4), correction=0)
        ref = (mean_ref.view(s, -1), var_ref.view(s, -1))
        gbytes = x.numel() * x.element_size() / 1e9
        row = {"shape": [n, c, h, w], "count": count, "gbytes": gbytes}

        def err(out):
            return max(float((o.double() - r).abs().max() / r.abs().max()) for o, r in zip(out, ref))

        for name, fn in inductor.items():
            row[f"inductor_{name}_us"] = time_graph(lambda: fn(x), args.rep_ms)
            row[f"inductor_{name}_err"] = err(fn(x))
        best = None
        for cfg in candidates(c, n // s * h * w, s):
            try:
                us = time_graph(lambda: segment_stats(x, s, cfg), args.rep_ms)
            except Exception as e:   # noqa: BLE001 -- a configuration the GPU cannot run
                print(f"  {cfg}: {type(e).__name__}: {str(e)[:100]}")
                continue
            e = err(segment_stats(x, s, cfg))
            if e > 1e-4:
                print(f"  {cfg}: relative error {e:.2e}, skipped")
                continue
            if best is None or us < best[0]:
                best = (us, cfg, e)
        row["triton_default_us"] = time_graph(lambda: segment_stats(x, s), args.rep_ms)
        row["triton_best_us"], row["triton_best_config"], row["triton_best_err"] = best
        results.append(row)
        print(f"{n}x{c}x{h}x{w} ({gbytes * 1e3:.0f} MB, x{count}): Inductor untuned {row['inductor_untuned_us']:.1f} us "
              f"({gbytes / row['inductor_untuned_us'] * 1e6 / 1e3:.2f} TB/s), tuned {row['inductor_tuned_us']:.1f}; "
              f"Triton default {row['triton_default_us']:.1f}, best {best[0]:.1f} "
              f"({gbytes / best[0] * 1e6 / 1e3:.2f} TB/s) {best[1]}; errors {row['inductor_untuned_err']:.1e} "
              f"{best[2]:.1e}", flush=True)
    for key in ("inductor_untuned_us", "inductor_tuned_us", "triton_default_us", "triton_best_us"):
        print(f"a step's {key[:-3]}: {sum(r[key] * r['count'] for r in results) / 1e3:.3f} ms")
    if args.out:
        info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}
        args.out.write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
