"""Training-step throughput of cowtune's trainer against a conventional pipeline, side by side.

    python benchmarks/throughput.py                       # every model x method on the GPU
    python benchmarks/throughput.py --data ../shared/datasets/cifar10-jpeg/train.zip
    python benchmarks/throughput.py --device cpu --tiny   # same code, tiny model, < 1 minute
    python benchmarks/throughput.py --packing 1,2,4,8 --data DIR --steps 100   # trials per GPU under Ray Tune
    python benchmarks/throughput.py --search 16 --epochs 30 --data DIR  # wall time of a whole search

For each model and method it times the full step as the trainer runs it (augmentation on the
device, masks, student and teacher passes, optimiser, EMA, metrics) at batch B labeled + B
unlabeled, then, in the same process on the same images, a conventional pipeline: a CPU
DataLoader with PIL transforms and float32 eager PyTorch. It prints steps/s, images/s, achieved
TFLOP/s, the fraction of the per-kernel roofline, and peak memory.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_required import require_gpu  # noqa: E402
from roofline import device_peaks, measure_step_cost  # noqa: E402

from trainables.config import DataConfig, TrainConfig  # noqa: E402
from trainables.data import Batch, DeviceData, RawDataset, load_raw, make_splits  # noqa: E402
from trainables.models import MODELS  # noqa: E402
from trainables.step import StepRunner  # noqa: E402
from trainables.trainer import autotune_convolutions, build_runner  # noqa: E402

METHODS = {
    "supervised": {},
    "mean_teacher": {"perturb": {"name": "mean_teacher"}},
    "cowout": {"perturb": {"name": "cowout"}},
    "cowmix": {"mix": {"name": "cowmix"}},
    "cutmix": {"mix": {"name": "cutmix"}},
}


def load_images(path: str | None, n_synthetic: int) -> RawDataset:
    if path:
        return load_raw(DataConfig(dataset="imagefolder", root=path, n_val=0, n_labeled=-1, eval_split="test"))
    rng = np.random.default_rng(0)
    labels = np.arange(n_synthetic) % 10
    images = rng.integers(0, 256, (n_synthetic, 32, 32, 3), dtype=np.uint8)
    return RawDataset("synthetic", images, labels, None, None, [str(i) for i in range(10)],
                      (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), True, "synthetic")


def make_config(model: str, method: str, batch: int, device: str, fast: bool, compile_: bool,
                compile_mode: str = "reduce-overhead", cuda_graph: str = "step", stack: bool = True,
                conv_kernels: str = "triton", wgrad_stream: bool = True,
                combo_kernels: bool | None = None, compile_masks_and_losses: bool = True,
                tune_kernels: bool | None = None, realize_reads_threshold: int | None = None,
                dependent_launch: bool | None = None) -> TrainConfig:
    return TrainConfig.from_dict({
        "model": model, **METHODS[method],
        "data": {"dataset": "cifar10", "n_val": 0, "n_labeled": 1000, "eval_split": "test"},
        "train": {"batch_size": batch, "device": device, "fast": {
            "precision": "bf16" if fast else "fp32", "channels_last": fast, "compile": fast and compile_,
            "compile_mode": compile_mode, "cuda_graph": cuda_graph if fast else "none",
            "stack_student_calls": fast and stack, "conv_kernels": conv_kernels if fast else "cudnn",
            "wgrad_stream": fast and wgrad_stream, "combo_kernels": combo_kernels,
            "compile_masks_and_losses": compile_masks_and_losses, "tune_kernels": tune_kernels,
            "realize_reads_threshold": realize_reads_threshold, "dependent_launch": dependent_launch}},
    })


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(runner: StepRunner, batches, gen, warmup: int, steps: int, device: torch.device) -> float:
    """Seconds per step, after ``warmup`` untimed steps (compilation, cuDNN autotuning)."""
    it = iter(batches)
    for _ in range(warmup):
        runner.step(next(it), gen, 0.05, 0.97)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        runner.step(next(it), gen, 0.05, 0.97)
    runner.read_metrics()  # the trainer's one sync per epoch
    sync(device)
    return (time.perf_counter() - t0) / steps


def conventional_batches(raw: RawDataset, splits, batch: int, steps: int, augment_twice: bool, device, workers: int):
    """CPU DataLoader + PIL transforms (pad 4 reflect, crop, flip, ToTensor, Normalize), float32."""
    import torchvision.transforms as T
    from PIL import Image

    tf = T.Compose([T.RandomCrop(32, padding=4, padding_mode="reflect"), T.RandomHorizontalFlip(),
                    T.ToTensor(), T.Normalize(raw.mean, raw.std)])

    class Images(torch.utils.data.Dataset):
        def __init__(self, idx):
            self.idx = idx

        def __len__(self):
            return len(self.idx)

        def __getitem__(self, i):
            j = self.idx[i]
            img = Image.fromarray(raw.train_images[j])
            views = [tf(img)] + ([tf(img)] if augment_twice else [])
            return (*views, int(raw.train_labels[j]))

    def loader(idx):
        sampler = torch.utils.data.RandomSampler(Images(idx), replacement=True, num_samples=batch * steps)
        return torch.utils.data.DataLoader(Images(idx), batch_size=batch, sampler=sampler, num_workers=workers,
                                           pin_memory=device.type == "cuda", drop_last=True)

    for sup, unsup in zip(loader(splits.labeled), loader(splits.unlabeled)):
        x_sup, y = sup[0].to(device, non_blocking=True), sup[-1].to(device, non_blocking=True)
        u0 = unsup[0].to(device, non_blocking=True)
        u1 = unsup[1].to(device, non_blocking=True) if augment_twice else u0
        yield Batch(x_sup, y, u0, u1)


def bench_one(model: str, method: str, raw: RawDataset, splits, args, device: torch.device) -> dict:
    peaks = device_peaks(device)
    row = {"model": model, "method": method, "batch": args.batch}
    images_per_step = args.batch * (1 if method == "supervised" else 2)
    for label, fast in (("fast", True), ("conventional", False)):
        if label == "conventional" and args.no_baseline:
            continue
        cfg = make_config(model, method, args.batch, str(device), fast, not args.no_compile, args.compile_mode,
                          args.cuda_graph, not args.separate_calls, args.conv_kernels)
        runner = build_runner(cfg, len(raw.class_names), device)
        gen = runner.generator.manual_seed(0)
        twice = cfg.perturb is not None and cfg.perturb.regularizer.augment_twice
        total = args.warmup + args.steps
        if fast:
            data = DeviceData(raw, splits, True, 4, device)
            batches = data.train_batches(0, 0, args.batch, total, twice)
        else:
            batches = conventional_batches(raw, splits, args.batch, total, twice, device, args.workers)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sec = time_steps(runner, batches, gen, args.warmup, args.steps, device)
        if not fast:
            batches.close()  # stop the DataLoader workers before the next fast measurement
        row[f"{label}_steps_per_s"] = 1.0 / sec
        row[f"{label}_images_per_s"] = images_per_step / sec
        if device.type == "cuda":
            row[f"{label}_peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        if fast:
            # FLOPs and roofline of the same step, counted eagerly (op by op) on one batch, with one student
            # call per batch: eagerly, a stacked call's per-batch batch norm adds a concatenation per layer
            # that the compiled step fuses away, and the roofline should count the work, not our layout of it
            eager = build_runner(make_config(model, method, args.batch, str(device), True, False, cuda_graph="none",
                                            stack=False), len(raw.class_names), device)
            batch = next(iter(DeviceData(raw, splits, True, 4, device).train_batches(1, 0, args.batch, 1, twice)))
            cost = measure_step_cost(lambda: eager.step(batch, eager.generator.manual_seed(0), 0.05, 0.97),
                                     peaks[1] if peaks else 1e15, peaks[2] if peaks else 1e12)
            row["gflop_per_step"] = cost.flops / 1e9
            row["tflops"] = cost.flops / sec / 1e12
            row["kernels_per_step"] = cost.ops
            if peaks:
                row["roofline_steps_per_s"] = 1.0 / cost.roofline_s
                row["roofline_fraction"] = cost.roofline_s / sec
        del runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "conventional_steps_per_s" in row:
        row["speedup"] = row["fast_steps_per_s"] / row["conventional_steps_per_s"]
    return row


def print_table(rows: list[dict]) -> None:
    cols = [("model", "model", "{}"), ("method", "method", "{}"), ("fast_steps_per_s", "steps/s", "{:.1f}"),
            ("fast_images_per_s", "img/s", "{:.0f}"), ("tflops", "TFLOP/s", "{:.1f}"),
            ("roofline_steps_per_s", "roofline steps/s", "{:.0f}"), ("roofline_fraction", "of roofline", "{:.0%}"),
            ("fast_peak_mem_gib", "peak GiB", "{:.2f}"), ("conventional_steps_per_s", "conv. steps/s", "{:.1f}"),
            ("speedup", "speed-up", "{:.1f}x")]
    cols = [c for c in cols if any(c[0] in r for r in rows)]
    cells = [[c[1] for c in cols]] + [[(c[2].format(r[c[0]]) if c[0] in r else "-") for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    for j, row in enumerate(cells):
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def packing_mode(args) -> int:
    from packing import measure_packing, print_packing

    ks = [int(k) for k in args.packing.split(",")]
    model = "cnn_tiny" if args.tiny else "wrn28_2"
    if args.tiny:
        args.batch = 16
    data = ({"dataset": "imagefolder", "root": str(Path(args.data).resolve()), "n_val": 5000}
            if args.data else {"dataset": "digits", "n_val": 300})
    train_config = {"model": model, "mix": {"name": "cowmix"},
                    "data": {**data, "n_labeled": 100 if args.tiny else 1000},
                    "train": {"batch_size": args.batch, "epochs": args.epochs, "steps_per_epoch": args.steps,
                              "device": args.device, "eval_batch_size": 1000,
                              "fast": {"gpu_turns": not args.no_gpu_turns}}}
    gpus = torch.cuda.device_count() if args.device.startswith("cuda") else 0
    where = torch.cuda.get_device_name() if gpus else "cpu"
    print(f"# packing on {where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}: {model} CowMix, "
          f"batch {args.batch}+{args.batch}, {args.epochs} epochs x {args.steps} steps per trial, "
          f"{'time-sliced' if args.no_gpu_turns else 'taking turns'} when packed", flush=True)
    rows = measure_packing(train_config, ks, gpus)
    print_packing(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": where, "date": time.strftime("%Y-%m-%d"), "rows": rows},
                                              indent=2))
    return 0


def search_mode(args) -> int:
    from search_wall import print_search, run_search_timed

    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"   # a GPU: checked in main
    print(f"# search wall time on {where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}: "
          f"{args.search} {'cnn_tiny smoke' if args.tiny else 'WRN-28-2'} CowMix trials x {args.epochs} epochs",
          flush=True)
    extra = ["--set", "train.device=cpu"] if args.device == "cpu" else [
        "--set", f"train.fast.cuda_graph={args.cuda_graph}", "--set", f"train.fast.conv_kernels={args.conv_kernels}"]
    if args.concurrency:
        extra += ["--concurrency", str(args.concurrency)]
    if args.no_gpu_turns:
        extra += ["--set", "train.fast.gpu_turns=false"]
    result = run_search_timed(args.search, args.epochs, args.data, "wrn28_2", args.tiny, extra)
    print_search(result, args.epochs)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": where, "date": time.strftime("%Y-%m-%d"), **result}, indent=2))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", help="cuda (the default where there is a GPU) or cpu")
    p.add_argument("--models", default="wrn28_2,wrn26_6_shakeshake")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=50, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=15, help="untimed steps first (compilation)")
    p.add_argument("--data", help="ImageFolder tree or .zip (default: synthetic CIFAR-sized images)")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="conventional DataLoader workers")
    p.add_argument("--no-baseline", action="store_true", help="skip the conventional pipeline")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--compile-mode", default="reduce-overhead")
    p.add_argument("--cuda-graph", default="step", choices=("step", "model", "none"),
                   help="one CUDA graph per step, torch.compile's graphs per model pass, or none")
    p.add_argument("--separate-calls", action="store_true",
                   help="one student call per batch instead of one stacked call "
                        "(train.fast.stack_student_calls=false)")
    p.add_argument("--conv-kernels", default="triton", choices=("cudnn", "triton"),
                   help="the fast pipeline's 3x3 convolutions: our Triton kernels where they beat cuDNN (the "
                        "trainer's default), or cuDNN for all (train.fast.conv_kernels)")
    p.add_argument("--tiny", action="store_true", help="cnn_tiny, batch 16, a few steps: a smoke run for CI")
    p.add_argument("--json", help="also write the rows as JSON here")
    p.add_argument("--packing", metavar="K,K,...", help="packing mode: k WRN-28-2 CowMix trials at once under "
                   "Ray Tune, each with 1/k of the GPU (e.g. 1,2,4,8)")
    p.add_argument("--search", type=int, metavar="N", help="search mode: run the CowMix search script with N "
                   "WRN-28-2 trials (Ray Tune, Optuna, ASHA, MLflow) and print its wall time")
    p.add_argument("--epochs", type=int, default=3, help="packing and search modes: epochs per trial")
    p.add_argument("--no-gpu-turns", action="store_true",
                   help="packing and search modes: packed trials time-slice the GPU instead of taking turns")
    p.add_argument("--concurrency", type=int, help="search mode: trials at once (default: as many as the "
                   "trainable's GPU fraction lets share a GPU)")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    if args.device is None:
        if not gpu and not (args.tiny or args.packing or args.search):
            p.error("no CUDA GPU here, and the table times the GPU training step: --device cpu --tiny is the CPU "
                    "smoke run (under a minute), --device cpu times the full models on the CPU (hours)")
        args.device = "cuda" if gpu else "cpu"
    try:
        torch.device(args.device)
    except RuntimeError:
        p.error(f"--device {args.device}: not a device (cuda, cuda:N or cpu)")
    if args.device.startswith("cuda"):
        require_gpu("throughput.py", "--device cpu --tiny is the CPU smoke run")
    if args.packing:
        return packing_mode(args)
    if args.search:
        return search_mode(args)
    if args.tiny:
        args.models, args.batch, args.steps, args.warmup, args.workers = "cnn_tiny", 16, 3, 1, 0
        args.no_compile, args.epochs = True, 2
    device = torch.device(args.device)
    if device.type == "cuda":
        autotune_convolutions()   # as the trainer does unless train.deterministic
    for method in args.methods.split(","):
        if method not in METHODS:
            p.error(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    for model in args.models.split(","):
        if model not in MODELS:
            p.error(f"unknown model {model!r}; known: {', '.join(MODELS)}")
    raw = load_images(args.data, 2000 if args.tiny else 50000)
    splits = make_splits(raw.train_labels, 0, 131, 1000 if not args.tiny else 100, 0, raw.fingerprint)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# throughput on {where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, "
          f"batch {args.batch} labeled + {args.batch} unlabeled, data {raw.name}", flush=True)
    rows = []
    for model in args.models.split(","):
        for method in args.methods.split(","):
            rows.append(bench_one(model, method, raw, splits, args, device))
            if args.json:  # written after every row, so an interrupted run keeps what it measured
                Path(args.json).write_text(json.dumps({"device": where, "torch": torch.__version__,
                                                       "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=2))
            r = rows[-1]
            print(f"  {model} {method}: {r['fast_steps_per_s']:.1f} steps/s"
                  + (f" (conventional {r['conventional_steps_per_s']:.1f})" if "conventional_steps_per_s" in r else ""),
                  flush=True)
    print()
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
