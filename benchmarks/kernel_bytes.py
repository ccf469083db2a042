"""The bytes each of Inductor's kernels moves in a profiled step, and the bandwidth it reached.

A profile says how long each kernel ran; Inductor's generated code says how many bytes it reads and writes
(``kernel_num_gb``, written when ``TORCHINDUCTOR_BENCHMARK_KERNEL=1``). Joined by kernel name, they tell a kernel
that runs slowly from one that moves more than it should (a result recomputed from many inputs, say).
``profile_step.py --kernel-bytes`` does it all in one run (its own cache directory, the byte counts, this table);
this script joins a trace and a cache kept from an earlier run:

    TORCHINDUCTOR_CACHE_DIR=/tmp/ic TORCHINDUCTOR_BENCHMARK_KERNEL=1 python benchmarks/profile_step.py \\
        --model wrn26_6_shakeshake --untuned --serial --steps 10 --trace trace.json
    python benchmarks/kernel_bytes.py trace.json /tmp/ic --steps 10 --top 40

Prints, per kernel, its time and launches a step, megabytes a launch and TB/s, and the module it comes from
(forward, backward or inference graph); then each module kind's time and gigabytes a step, and the time those
bytes take at ``--bandwidth``. Kernels are matched by name, and names repeat across modules, so give it a fresh
cache directory of the one run (or all of the run's module files): a name that two modules give different byte
counts is left without a bandwidth, and a trace kernel whose module was not given takes the bytes of a namesake.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

BANDWIDTH = 3.35   # TB/s, an H100 SXM's memory (an H200's: 4.8)
TOP = 40
KERNEL_META = re.compile(r"'kernel_name': '(\w+)'.*?'kernel_num_gb': ([0-9.eE+-]+)")


def module_kind(source: str) -> str:
    """The graph a compiled module runs: backward (it takes the gradients ``tangents_N``), forward (it takes the
    ``primals_N`` of a training graph) or inference."""
    if "tangents_1" in source:
        return "backward"
    return "forward" if "primals_1" in source else "inference"


def kernel_bytes(paths: list[Path]) -> dict[str, set[tuple[str, float]]]:
    """Kernel name -> {(module kind, gigabytes a launch)} over Inductor's generated modules ``paths`` (files, or
    directories searched for them)."""
    found: dict[str, set[tuple[str, float]]] = collections.defaultdict(set)
    files = [f for path in paths for f in ([path] if path.is_file() else sorted(path.rglob("*.py")))]
    for path in files:
        source = path.read_text(errors="replace")
        # a graph's module, which defines its kernels from their sources; the cache also holds each kernel alone
        # in a file of its own (with a call() to benchmark it), which says nothing of the graph it belongs to
        if "kernel_num_gb" not in source or "async_compile.triton(" not in source:
            continue
        kind = module_kind(source)
        for name, gb in KERNEL_META.findall(source):
            found[name].add((kind, float(gb)))
    return found


@dataclass
class Row:
    name: str
    us: float                 # a step
    launches: float           # a step
    kind: str                 # forward, backward, inference; "?" when not found or ambiguous
    gb: float | None = None   # a launch

    @property
    def tb_per_s(self) -> float | None:
        return None if self.gb is None or self.us <= 0 else self.gb * self.launches / self.us * 1e3


def rows(trace: dict, found: dict[str, set[tuple[str, float]]], steps: int) -> list[Row]:
    """One row per Triton kernel of the trace, slowest first."""
    time: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for e in trace.get("traceEvents", []):
        if e.get("cat") == "kernel" and e.get("name", "").startswith("triton"):
            time[e["name"]][0] += e.get("dur", 0.0)
            time[e["name"]][1] += 1
    out = []
    for name, (us, n) in time.items():
        seen = found.get(name, set())
        sizes = {gb for _, gb in seen}
        kinds = sorted({kind for kind, _ in seen})
        one = len(sizes) == 1
        out.append(Row(name, us / steps, n / steps, kinds[0] if one and len(kinds) == 1 else "?",
                       next(iter(sizes)) if one else None))
    return sorted(out, key=lambda r: -r.us)


def summary(table: list[Row], bandwidth: float) -> dict[str, tuple[float, float, float]]:
    """Module kind -> (microseconds, gigabytes, microseconds at ``bandwidth`` TB/s) a step; kernels of unknown
    size count in the time only."""
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for r in table:
        acc = out[r.kind]
        acc[0] += r.us
        if r.gb is not None:
            acc[1] += r.gb * r.launches
            acc[2] += r.gb * r.launches / bandwidth * 1e3
    return {k: (v[0], v[1], v[2]) for k, v in out.items()}


def print_table(table: list[Row], bandwidth: float, top: int) -> None:
    for kind, (us, gb, ideal) in sorted(summary(table, bandwidth).items()):
        print(f"{kind:>10}: {us:8.0f} us a step, {gb:6.2f} GB" + (f", {ideal:8.0f} us at {bandwidth} TB/s" if gb else ""))
    for r in table[:top]:
        mb = f"{r.gb * 1e3:8.1f} MB" if r.gb is not None else "       ? MB"
        bw = f"{r.tb_per_s:5.2f} TB/s" if r.tb_per_s is not None else "    ? TB/s"
        print(f"{r.us:8.1f} us {r.launches:5.1f}x {r.kind:>9} {mb} {bw}  {r.name}")


def load_trace(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path, help="Chrome trace of the profiled steps (profile_step.py --trace), or .gz")
    p.add_argument("code", type=Path, nargs="+",
                   help="Inductor's cache directory (TORCHINDUCTOR_CACHE_DIR) of that run alone, or its module files")
    p.add_argument("--steps", type=int, default=20, help="steps in the trace (profile_step.py --steps)")
    p.add_argument("--top", type=int, default=TOP)
    p.add_argument("--bandwidth", type=float, default=BANDWIDTH, help=f"TB/s to set the bytes against ({BANDWIDTH})")
    args = p.parse_args(argv)
    for path in (args.trace, *args.code):
        if not path.exists():
            p.error(f"{path}: not found")
    found = kernel_bytes(args.code)
    if not found:
        p.error(f"{' '.join(map(str, args.code))}: no kernel with kernel_num_gb "
                "(compile with TORCHINDUCTOR_BENCHMARK_KERNEL=1)")
    print_table(rows(load_trace(args.trace), found, args.steps), args.bandwidth, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
