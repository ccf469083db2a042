"""CowMix steps/s and images/s on ImageNet-shaped JPEGs through cowtune's large-image inputs (issue 55).

    python benchmarks/imagenet_pipeline.py                  # one GPU: resnet50, resnet152 x every input
    python benchmarks/imagenet_pipeline.py --world 1,2,4,8  # and the data-parallel step's scaling on 1..8 GPUs
    python benchmarks/imagenet_pipeline.py --smoke          # CPU, a tiny tree and model, seconds (tests/ runs it)

It writes a tree shaped like ImageNet's training split (``--tree``, made once and reused: JPEGs of ImageNet's usual
sizes, mostly 500x375 and 375x500, quality 90, ``--classes`` x ``--per-class`` files, 10% of them labeled), evicts
its files from the page cache (``posix_fadvise`` DONTNEED, no root needed) before each case that reads them, and
times the trainer's CowMix step (``imagenet_cowmix``'s config at ``--batch`` labeled + ``--batch`` unlabeled images
a step: 128 is one GPU's share of the paper's 1024 on 8 GPUs, 16 its share on 64) fed four ways:

  pil         data.decode pil: PIL decodes, inception-crops, flips and jitters in ``--workers`` DataLoader workers
  device      data.decode device: host threads read the bytes; nvJPEG decodes, the GPU crops, resizes and jitters
  hybrid      data.decode hybrid at each of ``--fractions``: that share of each batch's rows by PIL in the workers,
              the rest by nvJPEG, merged on the GPU (one row per fraction, "cpu_fraction" in it)
  predecoded  the device case's first batches made once and kept on the GPU, replayed: the step alone, the ceiling

``--batches`` adds other per-GPU batches, each through ``--batch-cases`` (pil, device, predecoded). One JSON line per
case (GPU, torch and torchvision versions, commit, the settings, the case's wall time), then a summary line: each
input's ratio to predecoded per model and batch (the target: >= 0.9 for resnet50), the best input, what
``data.decode auto``'s rule picks there and how that measured, and the paper's run (180 epochs x 1,251 steps of
1024 + 1024 images) projected onto 8 and 64 GPUs from one GPU's rate at its share of the batch, assuming perfect
scaling unless ``--world`` measured it. The models run eagerly (bf16, channels-last, cuDNN) unless ``--compile``:
compiling ResNet-152 takes minutes, the same for every case, and is not what is compared here.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import io
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # run as a script from anywhere: the repo's packages

SIZES = ((500, 375), (375, 500), (500, 333), (500, 500), (333, 500))   # ImageNet's usual shapes (width, height) ...
SIZE_WEIGHTS = (0.55, 0.2, 0.15, 0.05, 0.05)                           # ... roughly as often as there
PAPER_STEPS = 180 * 1251        # the paper's ImageNet run: 180 epochs of 1,281,167 // 1024 steps
PAPER_BATCH = 1024
EAGER = ["train.fast.compile=false", "train.fast.cuda_graph=none", "train.fast.conv_kernels=cudnn",
         "train.fast.wgrad_stream=false"]


# ---------------------------------------------------------------------------------------------
# The tree
# ---------------------------------------------------------------------------------------------

def photo(width: int, height: int, seed: int) -> np.ndarray:
    """A photo-like RGB uint8 (height, width, 3): smooth colour regions, edges and sensor noise, so that JPEG
    files come out about as large as ImageNet's (white noise would be far larger, flat colour far smaller)."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (rng.integers(3, 9), rng.integers(3, 9), 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC), dtype=np.float32)
    yy, xx = np.mgrid[0:height, 0:width]
    for _ in range(3):   # a few hard-edged shapes
        cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(15, 120)
        img[(xx - cx) ** 2 + (yy - cy) ** 2 < r * r] = rng.uniform(0, 255, 3)
    img += rng.normal(0, 16, img.shape) + 20 * np.sin(xx / rng.uniform(2, 9))[..., None]   # noise and texture
    return np.clip(img, 0, 255).astype(np.uint8)


def _write_one(job: tuple[str, int, int, int, int]) -> int:
    from PIL import Image
    path, width, height, quality, seed = job
    buf = io.BytesIO()
    Image.fromarray(photo(width, height, seed)).save(buf, "JPEG", quality=quality)
    Path(path).write_bytes(buf.getvalue())
    return len(buf.getvalue())


def write_tree(root: Path, classes: int, per_class: int, val_per_class: int, quality: int = 90,
               sizes: tuple[tuple[int, int], ...] = SIZES, processes: int | None = None, seed: int = 0) -> dict:
    """An ImageNet-layout tree: ``root/train/n<8 digits>/<n>.JPEG`` (``per_class`` each) and ``root/val/...``
    (``val_per_class`` each), about 87 KB a 500x375 file at quality 90 (ImageNet's training files average about
    110 KB). Made once: a tree whose ``tree.json`` records the same settings is reused. ``processes`` 1: in this
    process. Returns that record (files, bytes)."""
    record = {"classes": classes, "per_class": per_class, "val_per_class": val_per_class, "quality": quality,
              "sizes": [list(s) for s in sizes], "seed": seed}
    meta = root / "tree.json"
    if meta.exists() and {k: v for k, v in json.loads(meta.read_text()).items() if k in record} == record:
        return json.loads(meta.read_text())
    shutil.rmtree(root, ignore_errors=True)
    rng = np.random.default_rng(seed)
    weights = np.array(SIZE_WEIGHTS[:len(sizes)]) / sum(SIZE_WEIGHTS[:len(sizes)])
    jobs = []
    for split, count in (("train", per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                w, h = sizes[rng.choice(len(sizes), p=weights)]
                jobs.append((str(folder / f"{split}_{c}_{i}.JPEG"), w, h, quality, int(rng.integers(2 ** 31))))
    if processes == 1:
        sizes_written = [_write_one(job) for job in jobs]
    else:
        with ProcessPoolExecutor(processes or os.cpu_count()) as pool:
            sizes_written = list(pool.map(_write_one, jobs, chunksize=64))
    record |= {"files": len(jobs), "bytes": int(sum(sizes_written))}
    meta.write_text(json.dumps(record))
    return record


def evict(root: Path) -> bool:
    """Drop the tree's files from the page cache (written back first), so the next case reads them from the disk;
    False where the OS has no ``posix_fadvise``."""
    if not hasattr(os, "posix_fadvise"):
        return False
    os.sync()
    for folder, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


# ---------------------------------------------------------------------------------------------
# One case
# ---------------------------------------------------------------------------------------------

DECODE = {"pil": "pil", "device": "device", "predecoded": "device", "hybrid": "hybrid"}   # case -> data.decode


def case_config(model: str, case: str, tree: Path, n_labeled: int, args: argparse.Namespace,
                fraction: float | None = None):
    """``imagenet_cowmix`` on the tree, at ``args.batch``, fed as ``case`` asks (hybrid: at ``fraction``)."""
    from trainables.presets import load_config

    sets = [f"data.root={tree}", f"model={model}", f"train.batch_size={args.batch}", f"data.n_labeled={n_labeled}",
            f"data.decode={DECODE[case]}", f"data.workers={args.workers}",
            f"train.device={args.device}", "train.epochs=1"]
    if case == "hybrid":
        sets.append(f"data.cpu_fraction={fraction}")
    if args.smoke:
        sets += [f"data.image_size={args.image_size}", "train.threads=2", "train.eval_batch_size=8"]
    return load_config("imagenet_cowmix", sets + ([] if args.compile else EAGER) + args.set)


def time_steps(runner, batches, warmup: int, steps: int, seconds: float, device) -> tuple[float, int]:
    """(Seconds per step, steps timed) after ``warmup`` untimed steps (cuDNN's tuning, the loader's workers
    starting): at least ``steps`` steps and ``seconds`` of them. A window of many seconds matters for the PIL
    workers: each delivers a whole batch at a time, all of them at about the same time at first, and their
    prefetched batches would otherwise make a short window look faster than the workers are."""
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    gen = runner.generator.manual_seed(0)
    it = iter(batches)
    for _ in range(warmup):
        runner.step(next(it), gen, 0.16, 0.999)
    sync()
    t0 = time.perf_counter()
    done = 0
    for batch in it:
        runner.step(batch, gen, 0.16, 0.999)
        done += 1
        if done >= steps and time.perf_counter() - t0 >= seconds:
            break
    runner.read_metrics()   # the trainer's one sync per epoch
    sync()
    return (time.perf_counter() - t0) / done, done


def run_case(model: str, case: str, tree: Path, n_labeled: int, args: argparse.Namespace,
             fraction: float | None = None) -> dict:
    import torch

    from trainables.data import prepare_data
    from trainables.trainer import build_runner, setup_device

    start = time.monotonic()
    cfg = case_config(model, case, tree, n_labeled, args, fraction)
    device = setup_device(cfg)
    cold = evict(tree) if case != "predecoded" and not args.warm_cache else False
    data = prepare_data(cfg.data, cfg.labeled_seed, device, compiled=cfg.train.fast.compile)
    runner = build_runner(cfg, data.num_classes, device)
    total = args.warmup + max(args.steps, 3000)   # more than a window takes: produced lazily, closed after it
    batches = data.train_batches(0, cfg.seed, cfg.train.batch_size, total, False)
    if case == "predecoded":   # a few distinct batches on the device, replayed: no input work in the timed steps
        first = [next(batches) for _ in range(args.replayed)]
        batches.close()
        batches = (first[i % len(first)] for i in range(total))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sec, timed = time_steps(runner, batches, args.warmup, args.steps, args.seconds, device)
    if hasattr(batches, "close"):
        batches.close()
    row = {"case": case, "model": model, "method": cfg.method, "batch": cfg.train.batch_size,
           "images_per_step": 2 * cfg.train.batch_size, "steps_per_s": round(1 / sec, 3),
           "images_per_s": round(2 * cfg.train.batch_size / sec, 1), "image_size": data.image_size,
           "workers": args.workers if case in ("pil", "hybrid") else 0, "read_threads": getattr(data, "threads", 0),
           "cold_cache": cold, "compile": bool(runner.compiled), "precision": "bf16" if runner.bf16 else "fp32",
           "warmup": args.warmup, "steps": timed, "seconds": round(sec * timed, 2), "pipeline": data.describe()}
    if case == "hybrid":
        row["cpu_fraction"], row["host_rows"] = fraction, data.used[1]   # of the batch's rows, PIL decoded these
    if device.type == "cuda":
        row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 2)
    row["wall_s"] = round(time.monotonic() - start, 1)   # the whole case: data, model, warm-up, the timed steps
    del runner, data, batches
    gc.collect()   # the loader's workers and the device's memory go before the next case
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def run_scaling(model: str, tree: Path, n_labeled: int, world: int, args: argparse.Namespace) -> dict:
    """The data-parallel step (``trainables.data_parallel.launch_local``, NCCL) on ``world`` GPUs, each with
    ``args.batch`` images of the global batch, the device pipeline: epoch 2's training time (epoch 1 warms up)."""
    import dataclasses

    from trainables.data_parallel import launch_local

    cfg = case_config(model, "device", tree, n_labeled, args)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=args.batch * world, epochs=2,
                                                             steps_per_epoch=args.steps))
    out = Path(args.out or "/tmp") / f"scaling-{model}-w{world}"
    shutil.rmtree(out, ignore_errors=True)
    history = launch_local(cfg, world, out)
    last = history[-1]
    seconds = last.get("time/train_s", last["epoch_s"])
    return {"case": "data_parallel", "model": model, "world": world, "batch_per_worker": args.batch,
            "steps_per_s": round(args.steps / seconds, 3),
            "images_per_s": round(2 * args.batch * world * args.steps / seconds, 1),
            "replica_spread": last.get("replica_spread")}


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def environment(device: str) -> dict:
    import torch
    import torchvision
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=ROOT).stdout.strip()
    if commit.returncode != 0:   # a copy of the tree without its .git (a GPU machine's): $COWTUNE_COMMIT says which
        commit.stdout, dirty = os.environ.get("COWTUNE_COMMIT", "unknown (no .git: set COWTUNE_COMMIT)"), ""
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    return {"gpu": gpu, "gpus": torch.cuda.device_count(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "torchvision": torchvision.__version__, "commit": commit.stdout.strip() + ("+dirty" if dirty else ""),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def input_name(row: dict) -> str:
    """How a row was fed, as the summary names it: pil, device, predecoded or hybrid <fraction>."""
    return f"hybrid {row['cpu_fraction']:g}" if row["case"] == "hybrid" else row["case"]


def summary(rows: list[dict], workers: int) -> dict:
    """Each input's rate / predecoded per model and batch (and device's alone, as before), the best input, what
    ``data.decode auto`` picks there with ``workers`` workers (and its measured ratio where that fraction ran), and
    the paper's run projected from one GPU's rate at its share."""
    from trainables.data import auto_cpu_fraction

    out: dict = {"case": "summary", "ratio_device_to_predecoded": {}, "ratio_to_predecoded": {}, "best_input": {},
                 "auto_rule": {}, "paper_run_hours": {}}
    rate = {(input_name(r), r["model"], r["batch"]): r["steps_per_s"] for r in rows if "batch" in r}
    for (name, model, batch), steps_per_s in rate.items():
        key = f"{model}@{batch}"
        if ("predecoded", model, batch) in rate and name != "predecoded":
            ratio = round(steps_per_s / rate["predecoded", model, batch], 3)
            out["ratio_to_predecoded"].setdefault(key, {})[name] = ratio
            if name == "device":
                out["ratio_device_to_predecoded"][key] = ratio
        if name in ("device", "predecoded") and PAPER_BATCH % batch == 0:
            gpus = PAPER_BATCH // batch
            out["paper_run_hours"][f"{model} {name} on {gpus} GPUs (batch {batch} each, perfect scaling)"] = \
                round(PAPER_STEPS / steps_per_s / 3600, 1)
    for key, ratios in out["ratio_to_predecoded"].items():
        out["best_input"][key] = max(ratios, key=ratios.get)
        f = auto_cpu_fraction(int(key.rsplit("@", 1)[1]), workers)
        picked = "pil" if f == 1 else "device" if f == 0 else f"hybrid {f:g}"
        out["auto_rule"][key] = {"cpu_fraction": f, "measured_ratio": ratios.get(picked)}
    scaling = [r for r in rows if r["case"] == "data_parallel"]
    if scaling:
        one = {r["model"]: r["steps_per_s"] for r in scaling if r["world"] == 1}
        out["scaling_efficiency"] = {f"{r['model']} x{r['world']}": round(r["steps_per_s"] / one[r["model"]], 3)
                                     for r in scaling if r["model"] in one}
        for r in scaling:   # the paper's global batch on exactly these GPUs: the run's time as measured
            if r["world"] * r["batch_per_worker"] == PAPER_BATCH:
                out["paper_run_hours"][f"{r['model']} data-parallel on {r['world']} GPUs (measured)"] = \
                    round(PAPER_STEPS / r["steps_per_s"] / 3600, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, a tiny tree, cnn_tiny at 32 px, 2 + 2 steps")
    p.add_argument("--models", default="resnet50,resnet152")
    p.add_argument("--cases", default="pil,device,hybrid,predecoded")
    p.add_argument("--fractions", default="0.7,0.8", help="hybrid: data.cpu_fraction of each hybrid case")
    p.add_argument("--batch", type=int, default=128, help="labeled images a step (as many unlabeled); per GPU")
    p.add_argument("--batches", help="more per-GPU batches, e.g. 16 (64 GPUs), each through --batch-cases")
    p.add_argument("--batch-cases", default="pil,device,predecoded", help="the cases of each of --batches")
    p.add_argument("--tree", default="/tmp/cowtune-imagenet-tree", help="where the generated tree lives (reused)")
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--per-class", type=int, default=120, help="training images per class (default: 12,000 files, "
                   "about 1 GB; more than a case reads, and each case starts with them out of the page cache)")
    p.add_argument("--val-per-class", type=int, default=2)
    p.add_argument("--quality", type=int, default=90)
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="DataLoader workers (pil) / read threads")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20, help="timed steps per case, at least")
    p.add_argument("--seconds", type=float, default=10.0, help="timed seconds per case, at least")
    p.add_argument("--replayed", type=int, default=4, help="predecoded: distinct batches replayed")
    p.add_argument("--world", help="data-parallel scaling on these GPU counts, e.g. 1,2,4,8 (device pipeline)")
    p.add_argument("--compile", action="store_true", help="the trainer's whole fast path (torch.compile: minutes)")
    p.add_argument("--warm-cache", action="store_true", help="leave the tree in the page cache between cases")
    p.add_argument("--device", help="cuda (default where there is one) or cpu")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override, every case")
    p.add_argument("--out", help="also write the JSON lines to OUT/imagenet_pipeline.jsonl")
    args = p.parse_args(argv)
    for flag, names in (("--cases", args.cases), ("--batch-cases", args.batch_cases)):
        unknown = sorted(set(names.split(",")) - set(DECODE))
        if unknown:
            p.error(f"{flag}: unknown case {', '.join(unknown)} (known: {', '.join(DECODE)})")
    try:
        fractions = [float(f) for f in args.fractions.split(",")]
    except ValueError:
        p.error(f"--fractions must be numbers in [0, 1], got {args.fractions!r}")
    if not all(0 <= f <= 1 for f in fractions):
        p.error(f"--fractions must be numbers in [0, 1], got {args.fractions!r}")

    import torch
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.device, args.models, args.batch = "cpu", "cnn_tiny", 4
        args.classes, args.per_class, args.val_per_class, args.warmup, args.steps, args.seconds = 4, 6, 2, 2, 2, 0
        args.workers, args.replayed, args.image_size = min(2, args.workers or 1), 2, 32
        args.tree = str(Path(args.out or "/tmp") / "smoke-tree")
    tree, t0 = Path(args.tree), time.monotonic()
    made = write_tree(tree, args.classes, args.per_class, args.val_per_class, args.quality,
                      ((80, 60), (60, 80)) if args.smoke else SIZES, processes=2 if args.smoke else None)
    print(f"# tree {tree}: {made['files']} JPEGs, {made['bytes'] / 2 ** 20:.0f} MB ({time.monotonic() - t0:.0f} s)",
          file=sys.stderr, flush=True)
    n_labeled = max(args.classes, args.classes * args.per_class // 10)   # 10%, as the preset (floor)
    env = environment(args.device)
    lines: list[dict] = []
    saved = Path(args.out) / "imagenet_pipeline.jsonl" if args.out else None
    if saved:
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text("")

    def emit(row: dict) -> None:   # printed and saved as each case ends: a run cut short keeps what it measured
        row = {**row, **env, "tree_files": made["files"], "tree_mb": round(made["bytes"] / 2 ** 20, 1)}
        lines.append(row)
        print(json.dumps(row), flush=True)
        if saved:
            with open(saved, "a") as f:
                f.write(json.dumps(row) + "\n")

    def cases(names: str, at: argparse.Namespace) -> None:
        for case in names.split(","):
            for fraction in (fractions if case == "hybrid" else [None]):
                emit(run_case(model, case, tree, n_labeled, at, fraction))

    for model in args.models.split(","):
        cases(args.cases, args)
        for extra in (int(b) for b in (args.batches.split(",") if args.batches else [])):
            cases(args.batch_cases, argparse.Namespace(**{**vars(args), "batch": extra}))
        for world in (int(w) for w in (args.world.split(",") if args.world else [])):
            emit(run_scaling(model, tree, n_labeled, world, args))
    emit({**summary(lines, args.workers), "total_wall_s": round(time.monotonic() - t0, 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
