"""Which of cuDNN's ways of choosing a kernel is fastest for the shake-shake step's convolutions?

The trainer tunes cuDNN with every algorithm timed at a shape's first call (``benchmark_limit`` 0,
``trainer.autotune_convolutions``). This script times each convolution of the WRN-26 shake-shake 96x2d CowMix step
under each way of choosing, one process per way (cuDNN keeps a shape's first choice for the life of a process), and
adds them up with the number of times a step runs each: the student's forward, input and weight gradients at 512
images, and the folded teacher's forward at 256 (its first convolutions with bias and ReLU in cuDNN's epilogue,
``torch.cudnn_convolution_relu`` as ``conv_bias_relu`` runs them; the rest without their bias, which Inductor adds
in a kernel of its own). The ways:

- ``limit0``: benchmark on, every algorithm timed (the trainer's setting);
- ``limit10``: benchmark on, the 10 its heuristics rank first timed (PyTorch's default);
- ``heuristic``: benchmark off, the heuristics' first choice.

    python benchmarks/cudnn_modes.py [--repeats 2]       # all ways, alternating, a process each
    python benchmarks/cudnn_modes.py --mode limit0      # one way, in this process (JSON on the last line)

Measured: benchmarks/results/ (see docs/performance.md).
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_required import require_gpu  # noqa: E402
from shakeshake_convs import timed_us  # noqa: E402

MODES = {"limit0": (True, 0), "limit10": (True, 10), "heuristic": (False, 10)}

# (launches a step, input NCHW, weight KCRS, stride, padding, kind): the student's convolutions at batch 512 (train
# mode: forward, input gradient but for the stem's, weight gradient) and the folded teacher's at 256 (forward only:
# "fused" with bias and ReLU, "teacher" without its bias). Each block's first convolutions run stacked; stride-2
# convolutions take an input padded to SAME (33x33, 17x17) and padding 0. tests/test_benchmark.py checks the list
# against the model's own calls.
CONVS = (
    (1, (512, 3, 32, 32), (16, 3, 3, 3), 1, 1, "student"),
    (1, (512, 16, 32, 32), (192, 16, 3, 3), 1, 1, "student"),
    (1, (512, 16, 32, 32), (96, 16, 3, 3), 1, 1, "student"),
    (8, (512, 96, 32, 32), (96, 96, 3, 3), 1, 1, "student"),
    (3, (512, 96, 32, 32), (192, 96, 3, 3), 1, 1, "student"),
    (1, (512, 96, 33, 33), (384, 96, 3, 3), 2, 0, "student"),
    (1, (512, 96, 33, 33), (192, 96, 3, 3), 2, 0, "student"),
    (8, (512, 192, 16, 16), (192, 192, 3, 3), 1, 1, "student"),
    (3, (512, 192, 16, 16), (384, 192, 3, 3), 1, 1, "student"),
    (1, (512, 192, 17, 17), (768, 192, 3, 3), 2, 0, "student"),
    (1, (512, 192, 17, 17), (384, 192, 3, 3), 2, 0, "student"),
    (8, (512, 384, 8, 8), (384, 384, 3, 3), 1, 1, "student"),
    (3, (512, 384, 8, 8), (768, 384, 3, 3), 1, 1, "student"),
    (1, (256, 3, 32, 32), (16, 3, 3, 3), 1, 1, "teacher"),
    (1, (256, 16, 32, 32), (192, 16, 3, 3), 1, 1, "fused"),
    (1, (256, 16, 32, 32), (96, 16, 3, 3), 1, 1, "teacher"),
    (3, (256, 96, 32, 32), (192, 96, 3, 3), 1, 1, "fused"),
    (4, (256, 192, 32, 32), (96, 192, 3, 3), 1, 1, "teacher"),
    (1, (256, 96, 33, 33), (384, 96, 3, 3), 2, 0, "fused"),
    (1, (256, 96, 33, 33), (192, 96, 3, 3), 2, 0, "teacher"),
    (3, (256, 192, 16, 16), (384, 192, 3, 3), 1, 1, "fused"),
    (4, (256, 384, 16, 16), (192, 384, 3, 3), 1, 1, "teacher"),
    (1, (256, 192, 17, 17), (768, 192, 3, 3), 2, 0, "fused"),
    (1, (256, 192, 17, 17), (384, 192, 3, 3), 2, 0, "teacher"),
    (3, (256, 384, 8, 8), (768, 384, 3, 3), 1, 1, "fused"),
    (4, (256, 768, 8, 8), (384, 768, 3, 3), 1, 1, "teacher"),
)


def measure(mode: str) -> dict:
    """Each convolution's times (us) under ``mode``, in this process."""
    torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit = MODES[mode]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, scale=1.0):
        t = torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16) * scale
        return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t

    rows = []
    for count, xs, ws, stride, pad, kind in CONVS:
        x, w = rnd(*xs).relu(), rnd(*ws, scale=0.03)   # inputs half zeros, as after a ReLU
        if kind == "fused":
            b = rnd(ws[0], scale=0.1)
            times = {"forward": timed_us(lambda: torch.cudnn_convolution_relu(x, w, b, [stride] * 2, [pad] * 2,
                                                                              [1, 1], 1))}
        else:
            times = {"forward": timed_us(lambda: F.conv2d(x, w, None, stride, pad))}
        if kind == "student":
            dy = rnd(*F.conv2d(x, w, None, stride, pad).shape)
            for op, mask in (("input grad", [True, False, False]), ("weight grad", [False, True, False])):
                if op == "input grad" and xs[1] == 3:
                    continue   # the stem's: the images need none
                times[op] = timed_us(lambda: torch.ops.aten.convolution_backward(
                    dy, x, w, None, [stride] * 2, [pad] * 2, [1, 1], False, [0, 0], 1, mask))
        rows.append({"count": count, "input": xs, "weight": ws, "stride": stride, "kind": kind, "us": times})
        del x, w
    return {"mode": mode, "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}


def step_total(result: dict, model: str | None = None) -> float:
    """us a step: launches x times, over every convolution, or over the ``model``'s ("student" or "teacher")."""
    return sum(r["count"] * sum(r["us"].values()) for r in result["rows"]
               if model is None or (r["kind"] == "student") == (model == "student"))


def report(results: list[dict]) -> None:
    by_mode: dict[str, list[dict]] = {}
    for res in results:
        by_mode.setdefault(res["mode"], []).append(res)
    modes = list(by_mode)
    first = results[0]
    print(f"\n# {first['device']}, torch {first['torch']}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; us, best of {len(by_mode[modes[0]])} "
          "processes a way")
    print(f"{'convolution':44s} {'op':12s} " + " ".join(f"{m:>10s}" for m in modes))
    best_total = 0.0
    for i, row in enumerate(first["rows"]):
        label = (f"{row['count']}x {row['kind']} {row['input'][1]}->{row['weight'][0]} "
                 f"{row['input'][2]}x{row['input'][3]} /{row['stride']}")
        for op in row["us"]:
            best = {m: min(r["rows"][i]["us"][op] for r in by_mode[m]) for m in modes}
            best_total += row["count"] * min(best.values())
            print(f"{label:44s} {op:12s} " + " ".join(f"{best[m]:10.1f}" for m in modes))
    print()
    for model in (None, "student", "teacher"):
        label = f"a step{f', the {model}' if model else ''} (launches x us), ms"
        print(f"{label:57s} " + " ".join(f"{min(step_total(r, model) for r in by_mode[m]) / 1e3:10.2f}"
                                          for m in modes))
    print(f"each convolution under its fastest way: {best_total / 1e3:.2f} ms a step")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=sorted(MODES), help="one way, in this process")
    p.add_argument("--repeats", type=int, default=2, help="processes a way, alternating (all ways; 1 or more)")
    p.add_argument("--json", type=Path, help="all ways: write every process's times here")
    args = p.parse_args()
    if args.repeats < 1:
        p.error(f"--repeats must be 1 or more, not {args.repeats}")
    require_gpu("cudnn_modes.py")
    if args.mode:
        res = measure(args.mode)
        print(f"{args.mode}: {step_total(res) / 1e3:.2f} ms a step", flush=True)
        print(json.dumps(res))
        return 0
    results = []
    for rep in range(args.repeats):
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, "--mode", mode], capture_output=True, text=True)
            if out.returncode:
                sys.stderr.write(out.stderr)
                return out.returncode
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"  repeat {rep + 1}, {mode}: {step_total(results[-1]) / 1e3:.2f} ms a step", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
