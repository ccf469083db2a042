"""Where the GPU waits in a profiled run of captured steps: read from a Chrome trace of
``profile_step.py --trace`` (plain or .gz), per CUDA graph replay (one a training step):

- the step period, from one replay's first kernel to the next's;
- the graph's own span on the GPU, and the kernels launched outside it before it (the next batch's
  augmentation, copies into the graph's static inputs), with their span;
- the time no kernel ran on any stream (the GPU idle), and the longest such gaps;
- how far ahead of the GPU the host was: from cudaGraphLaunch's call to the replay's first kernel
  (near 0 or negative: the host is the bottleneck; large: the GPU is);
- with ``--windows US``, the replay cut into windows of that many microseconds: each stream's busy
  microseconds and its kernel classes (forward, backward and the optimiser's tail show as phases).

    python benchmarks/step_timeline.py trace.json.gz [--windows 200]

Found this way (H200, 2026-11-27): 0.29 ms of a 5.8 ms WRN-28-2 CowMix step idle between replays, the
augmentation's 64 small kernels, now launched once per 8 steps (trainables/data/device.py).
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics
import sys
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
CLASSES = (("conv_rows_fwd", "rows-fwd"), ("conv_rows_dgrad", "rows-dgrad"), ("conv_rows_wgrad", "rows-wgrad"),
           ("wgrad", "cudnn-wgrad"), ("dgrad", "cudnn-dgrad"), ("fprop", "cudnn-fwd"), ("convolve", "cudnn-fwd"),
           ("triton_red", "triton-red"), ("triton_per", "triton-red"), ("triton_poi", "triton-pw"),
           ("multi_tensor", "foreach"), ("reduce_kernel", "aten-red"), ("elementwise", "aten-pw"),
           ("Memcpy", "copy"), ("emset", "memset"))   # rows-fwd: forward and input gradient


def kernel_class(name: str) -> str:
    return next((c for key, c in CLASSES if key in name), "other")


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def replays(events: list[dict]) -> list[dict]:
    """Per cudaGraphLaunch, in order: its host call (ts, dur) and its kernels; plus the kernels launched
    outside any graph since the previous replay's last kernel ended (``before``)."""
    complete = [e for e in events if e.get("ph") == "X"]
    kernels = sorted((e for e in complete if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    launches = sorted((e for e in complete if e.get("cat") == "cuda_runtime"
                       and e["name"].startswith("cudaGraphLaunch")), key=lambda e: e["ts"])
    graph_of = {e["args"].get("correlation"): i for i, e in enumerate(launches)}
    per = [{"launch": e, "kernels": [], "before": []} for e in launches]
    loose = []
    for k in kernels:
        i = graph_of.get(k["args"].get("correlation"))
        (per[i]["kernels"] if i is not None else loose).append(k)
    out, prev_end = [], float("-inf")
    for r in per:
        if not r["kernels"]:
            continue
        start = r["kernels"][0]["ts"]
        r["before"] = [k for k in loose if prev_end <= k["ts"] < start]
        r["start"], r["end"] = start, max(k["ts"] + k["dur"] for k in r["kernels"])
        prev_end = r["end"]
        out.append(r)
    return out


def idle_gaps(kernels: list[dict], start: float, end: float) -> list[tuple[float, float]]:
    """(gap start, length) of the times in [start, end) when none of ``kernels`` ran."""
    gaps, t = [], start
    for k in sorted(kernels, key=lambda k: k["ts"]):
        if k["ts"] > t:
            gaps.append((t, k["ts"] - t))
        t = max(t, k["ts"] + k["dur"])
        if t >= end:
            break
    if t < end:
        gaps.append((t, end - t))
    return gaps


def summarise(events: list[dict], skip: int = 1) -> dict:
    """Medians over the replays after the first ``skip`` (and before the last, whose period has no end)."""
    rs = replays(events)
    if len(rs) < skip + 2:
        raise SystemExit(f"the trace holds {len(rs)} CUDA graph replays; need at least {skip + 2} "
                         "(profile a captured step: train.fast.cuda_graph step, more --steps)")
    all_kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    rows = []
    for r, nxt in zip(rs[skip:-1], rs[skip + 1:]):
        period_start = r["before"][0]["ts"] if r["before"] else r["start"]
        period_end = nxt["before"][0]["ts"] if nxt["before"] else nxt["start"]
        window = [k for k in all_kernels if k["ts"] < period_end and k["ts"] + k["dur"] > period_start]
        gaps = idle_gaps(window, period_start, period_end)
        before = r["before"]
        rows.append({"period_us": period_end - period_start, "graph_us": r["end"] - r["start"],
                     "graph_kernels": len(r["kernels"]), "outside_kernels": len(before),
                     "outside_span_us": (before[-1]["ts"] + before[-1]["dur"] - before[0]["ts"]) if before else 0.0,
                     "idle_us": sum(g for _, g in gaps), "longest_idle_us": max((g for _, g in gaps), default=0.0),
                     "host_launch_us": r["launch"]["dur"], "host_lead_us": r["start"] - r["launch"]["ts"]})
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]} | {"replays": len(rows)}


def windows(replay: dict, width: float) -> list[str]:
    """One line per ``width`` us of a replay: each stream's busy us and its commonest kernel classes."""
    lines, t0 = [], replay["start"]
    n = int((replay["end"] - t0) // width) + 1
    for i in range(n):
        a, b = t0 + i * width, t0 + (i + 1) * width
        busy, classes = collections.defaultdict(float), collections.defaultdict(collections.Counter)
        for k in replay["kernels"]:
            overlap = min(k["ts"] + k["dur"], b) - max(k["ts"], a)
            if overlap > 0:
                stream = k["args"].get("stream")
                busy[stream] += overlap
                classes[stream][kernel_class(k["name"])] += 1
        cells = [f"s{s}: {busy[s]:4.0f} " + " ".join(f"{c}x{m}" for c, m in classes[s].most_common(3))
                 for s in sorted(busy, key=str)]
        lines.append(f"{i * width:7.0f} us  " + " | ".join(cells))
    return lines


def report(events: list[dict], width: float | None = None) -> str:
    s = summarise(events)
    lines = [f"over {s['replays']} steps (medians): period {s['period_us']:.0f} us; the graph "
             f"{s['graph_us']:.0f} us ({s['graph_kernels']:.0f} kernels); outside it before each replay "
             f"{s['outside_kernels']:.0f} kernels over {s['outside_span_us']:.0f} us; GPU idle {s['idle_us']:.0f} us "
             f"(longest gap {s['longest_idle_us']:.0f} us); cudaGraphLaunch takes the host {s['host_launch_us']:.0f} us, "
             f"its first kernel starts {s['host_lead_us']:.0f} us after the call "
             f"({'the GPU is the bottleneck' if s['host_lead_us'] > s['period_us'] else 'the host keeps up only just or not'})"]
    if width:
        rs = replays(events)
        lines += [f"one replay in {width:.0f}-us windows, busy us per stream and kernel classes:"]
        lines += windows(rs[len(rs) // 2], width)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path, help="a Chrome trace from profile_step.py --trace (.json or .json.gz)")
    p.add_argument("--windows", type=float, metavar="US", help="also show one replay in windows of US microseconds")
    args = p.parse_args(argv)
    print(report(load(args.trace), args.windows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
