"""How long a trial's first step takes (compilation, cuDNN tuning, CUDA-graph capture), each run in a
fresh process as a new trial's is: with empty compile caches (a user's first search on a machine),
with the caches that run left, and warm again with cuDNN's default algorithm search instead of the
exhaustive one the trainer asks for.

    python benchmarks/first_step.py                        # WRN-28-2 CowMix on the GPU
    python benchmarks/first_step.py --device cpu --tiny    # the same code on CPU with a tiny model

Each process also times a second runner's first step (a reused Ray worker's next trial) and reports
how long Dynamo + Inductor took per compiled graph and whether the compile caches hit.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_START = time.monotonic()
ROOT = Path(__file__).resolve().parents[1]
RUNS = [("cold", None), ("warm", None), ("warm, cuDNN limit 10", 10)]   # in order: the first fills the caches


def child(args: argparse.Namespace) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from torch._dynamo.utils import compilation_time_metrics, counters

    from trainables.config import TrainConfig
    from trainables.data import DeviceData, make_splits
    from trainables.trainer import autotune_convolutions, build_runner

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from throughput import load_images

    imports_s = time.monotonic() - T_START
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        autotune_convolutions()
        if args.cudnn_limit is not None:
            torch.backends.cudnn.benchmark_limit = args.cudnn_limit
    cfg = TrainConfig.from_dict({   # throughput.make_config's, but compiled on the CPU too
        "model": args.model, "mix": {"name": "cowmix"},
        "data": {"dataset": "cifar10", "n_val": 0, "n_labeled": 1000, "eval_split": "test"},
        "train": {"batch_size": args.batch, "device": args.device, "fast": {
            "precision": "bf16" if cuda else "fp32", "channels_last": cuda, "compile": True,
            "cuda_graph": "step" if cuda else "none",
            # as a search's trial compiles it (trainables.fast.compile_options.tune_kernels_wanted)
            "tune_kernels": False,
            "dependent_launch": {"on": True, "off": False, "model": None}[args.dependent_launch]}}})

    raw = load_images(None, 2000)
    data = DeviceData(raw, make_splits(raw.train_labels, 0, 131, 1000, 0, raw.fingerprint), True, 4, device)
    batch = next(iter(data.train_batches(0, 0, args.batch, 1, False)))
    times, weights = [], []
    for _ in range(2):   # a new trial in a fresh process, then the next trial in the same process
        r = build_runner(cfg, 10, device)
        r.step(batch, r.generator.manual_seed(0), 0.05, 0.97)
        times.append(r.first_step)
        weights.append(sum(p.double().abs().sum() for p in r.student.parameters()).item())
    return {"imports_s": imports_s, "first_step_s": times[0]["time/first_step_s"],
            "compile_wait_s": times[0]["time/compile_wait_s"], "second_runner_first_step_s": times[1]["time/first_step_s"],
            "compile_s_per_graph": [round(t, 2) for t in compilation_time_metrics.get("_compile.compile_inner", [])],
            "compile_s_by_phase": dict(sorted(((k, round(sum(v), 2)) for k, v in compilation_time_metrics.items()
                                              if sum(v) >= 0.2), key=lambda kv: -kv[1])),
            "fx_graph_cache": {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")},
            "aot_autograd_cache": {k: v for k, v in counters["aot_autograd"].items() if k.startswith("autograd_cache")},
            "cudnn_benchmark_limit": torch.backends.cudnn.benchmark_limit if cuda else None,
            "weights_after_first_step": weights}   # sum |w| of the student after each runner's first step


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="cnn_tiny at batch 16 (CPU smoke run)")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--dependent-launch", choices=("model", "on", "off"), default="model",
                   help="train.fast.dependent_launch: the model's default (on for WRN-28-2 on a GPU), or on, or off")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cudnn-limit", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.model, args.batch = ("cnn_tiny", 16) if args.tiny else ("wrn28_2", 256)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    import torch

    if args.device.startswith("cuda"):
        from gpu_required import require_gpu   # this folder: on sys.path when run as a script

        require_gpu("first_step.py", "pass --device cpu (with --tiny for a quick run)")
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"# first step on {where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}: {args.model} CowMix, "
          f"batch {args.batch}+{args.batch}, dependent launch {args.dependent_launch}, each run a fresh process", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cowtune-first-step-") as work:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{work}/inductor", "TRITON_CACHE_DIR": f"{work}/triton",
               "PYTHONUNBUFFERED": "1"}
        for label, limit in RUNS:
            if where == "cpu" and limit is not None:
                continue   # cuDNN plays no part
            cmd = [sys.executable, __file__, "--child", "--device", args.device,
                   "--dependent-launch", args.dependent_launch] + (["--tiny"] if args.tiny else []) \
                + (["--cudnn-limit", str(limit)] if limit is not None else [])
            t0 = time.monotonic()
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"first_step: the {label} run failed:\n{out.stderr[-3000:]}")
            result = json.loads(next(line[7:] for line in out.stdout.splitlines() if line.startswith("RESULT ")))
            rows.append({"run": label, "process_s": time.monotonic() - t0, **result})
            print(f"{label:>22}: first step {result['first_step_s']:5.1f} s, the next trial's in the same process "
                  f"{result['second_runner_first_step_s']:.2f} s, imports {result['imports_s']:.1f} s; student sum |w| "
                  f"after the step {result['weights_after_first_step'][0]:.6f}", flush=True)
            print(f"{'':>22}  Dynamo + Inductor per graph {result['compile_s_per_graph']} s, "
                  f"{result['fx_graph_cache']}, {result['aot_autograd_cache']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": where, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                                               "model": args.model, "dependent_launch": args.dependent_launch,
                                               "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
