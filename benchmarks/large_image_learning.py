"""Learning at large resolution on real images (issue 55): CIFAR-10's JPEGs upsampled to 128 px, trained through the
large-image path (the ``imagenet_cowmix`` preset, ResNet-50, inception crops, data.decode auto), supervised and CowMix
on the same 10% of the labels, with per-epoch holdout error for both in one JSON and one PNG.

    COWTUNE_COMMIT=<sha> python3 benchmarks/large_image_learning.py --out $OUT/large_image   # one H200, ~5.5 minutes
    python3 benchmarks/large_image_learning.py plot OUT/large_image.json --out docs/results/large_image.png
    python3 benchmarks/large_image_learning.py --smoke --out /tmp/li   # CPU, a tiny tree, seconds (tests/ runs it)

1. The tree (``--tree``, made once and reused while its ``tree.json`` matches). Every JPEG of the zip (``--data``: the
   50,000 CIFAR-10 training images, 32 px, quality ~75) decoded, resized bicubically to ``--side`` px and saved at JPEG
   quality ``--quality``, by one process per core, into ImageNet's layout, the one ``cowtune final --datasets
   imagenet=DIR`` and the preset read:

       TREE/train/<class>/<name>.jpg   45,000 images: the training split (labeled subset and unlabeled pool)
       TREE/val/<class>/<name>.jpg      5,000 images: the holdout, read as the evaluation split (data.eval_split test)

   The holdout is the small-image runs' own: ``make_splits`` on the zip's labels in the trainer's order, 5,000
   stratified images at data.val_seed 131 (docs/RESULTS.md's 5,000-image holdout), so the errors here sit beside
   theirs. The labeled subset is the preset's rule, 10% of the tree's training images (floor), stratified per class
   at the run's seed: 4,500, the same images in both runs (their split hashes are recorded).
2. Two runs, one after the other, in this process through the trainer's entry (``trainables.trainer.fit``, as
   ``cowtune train imagenet_cowmix --set ...`` runs it; the JSON has each run's command): supervised (mix off), then
   CowMix. What each setting is and why it differs from the preset: ``settings()`` below and docs/imagenet.md.
3. ``--out``: ``large_image.json`` (rewritten after every epoch, so a run cut short keeps what it measured: settings,
   GPU, torch, commit, date, wall times, each run's per-epoch teacher and student holdout error), ``large_image.log``
   and ``large_image.png`` (where matplotlib imports; else draw it later with ``plot``). Checkpoints and the tree stay
   under ``--work`` and ``--tree`` (not under ``--out``: a GPU machine sends back few files).

``--budget-s`` bounds the whole command: a run whose next epoch would end past its share of the budget stops after
the epoch it is in (``stopped_by_budget`` in the JSON), so the command ends in time even where the GPU is slower than
estimated.
"""
from __future__ import annotations

import argparse
import gc
import io
import json
import os
import shutil
import sys
import time
import traceback
import zipfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # run as a script from anywhere: the repo's packages

from benchmarks.imagenet_pipeline import EAGER, environment   # noqa: E402  (the GPU benchmark's eager step, record)

PRESET = "imagenet_cowmix"
HOLDOUT = 5000          # the small-image runs' holdout (data.n_val 5000 at data.val_seed 131)
VAL_SEED = 131          # DataConfig.val_seed's default: the same 5,000 images as docs/RESULTS.md's runs
PRESET_SIDE = 224       # the preset's crop, which its sigma range (32, 128) is for
# What depends on the number of classes and on the run's length, not on the image size: the paper's CIFAR-10 values
# (the cifar10_cowmix preset), as 10 classes and a run of a few thousand steps are CIFAR's, not ImageNet's. The paper
# re-set omega and the threshold for 1,000 classes (30 -> 100, 0.6 -> 0.5); alpha 0.999 averages over 1,000 steps,
# right for ImageNet's 225,000 and over a quarter of this run's 3,510.
TEN_CLASS = ["mix.weight=30", "mix.conf_thresh=0.6", "teacher.alpha=0.97"]
RUNS = ("supervised", "cowmix")
COST = {"supervised": 0.42, "cowmix": 0.58}   # each run's share of the training budget (its estimated share of time)
LOG_NAME, JSON_NAME, PNG_NAME = "large_image.log", "large_image.json", "large_image.png"


# ---------------------------------------------------------------------------------------------
# The tree
# ---------------------------------------------------------------------------------------------

def source_files(zip_path: Path, per_class: int | None, holdout: int) -> tuple[list[tuple[str, str, bool]], list[str]]:
    """The zip's images as the trainer lists them: [(member name, class, in the holdout)], and the class names. With
    ``per_class``, only each class's first ``per_class`` images (in the trainer's order). The holdout is
    ``make_splits``'s, stratified at ``VAL_SEED``: on the whole zip, the small-image runs' 5,000 images."""
    import numpy as np

    from trainables.config import DataConfig
    from trainables.data import load_raw, make_splits

    raw = load_raw(DataConfig(dataset="imagefolder", root=str(zip_path), pipeline="loader"))   # listed, not decoded
    labels = raw.train_labels
    keep = np.arange(len(labels))
    if per_class is not None:
        keep = np.sort(np.concatenate([np.flatnonzero(labels == c)[:per_class] for c in range(len(raw.class_names))]))
    val = set(make_splits(labels[keep], holdout, VAL_SEED, -1, 0).val.tolist())
    return ([(str(raw.train_images.names[i]), raw.class_names[labels[i]], k in val) for k, i in enumerate(keep)],
            list(raw.class_names))


_ZIP: dict[str, zipfile.ZipFile] = {}


def _make_one(job: tuple[str, str, str, int, int]) -> int:
    """One file of the tree: a zip member decoded, resized bicubically to side x side, saved as a JPEG; its bytes."""
    from PIL import Image

    zip_path, member, dest, side, quality = job
    if zip_path not in _ZIP:   # one handle per worker process
        _ZIP[zip_path] = zipfile.ZipFile(zip_path)
    img = Image.open(io.BytesIO(_ZIP[zip_path].read(member))).convert("RGB")
    buf = io.BytesIO()
    img.resize((side, side), Image.BICUBIC).save(buf, "JPEG", quality=quality)
    Path(dest).write_bytes(buf.getvalue())
    return len(buf.getvalue())


def make_tree(zip_path: Path, tree: Path, side: int, quality: int, per_class: int | None, holdout: int,
              processes: int) -> dict:
    """The tree of the module docstring under ``tree`` (made again unless its ``tree.json`` records these settings
    and source); returns that record: settings, files per split and class count, bytes, the seconds it took."""
    st = zip_path.stat()
    record = {"source": str(zip_path), "source_bytes": st.st_size, "side": side, "quality": quality,
              "resample": "bicubic", "per_class": per_class, "holdout": holdout, "val_seed": VAL_SEED}
    meta = tree / "tree.json"
    if meta.exists():
        old = json.loads(meta.read_text())
        if {k: old.get(k) for k in record} == record:
            return {**old, "reused": True}
    if tree.exists() and any(tree.iterdir()) and not meta.exists():
        raise SystemExit(f"--tree {tree} holds files that this script did not write (no tree.json): "
                         "give another folder")
    t0 = time.monotonic()
    shutil.rmtree(tree, ignore_errors=True)   # a tree of other settings, or one cut short
    files, classes = source_files(zip_path, per_class, holdout)
    for split in ("train", "val"):
        for c in classes:
            (tree / split / c).mkdir(parents=True, exist_ok=True)
    jobs = [(str(zip_path), name, str(tree / ("val" if held else "train") / c / name.rsplit("/", 1)[-1]), side,
             quality) for name, c, held in files]
    with ProcessPoolExecutor(processes) as pool:
        written = list(pool.map(_make_one, jobs, chunksize=max(1, len(jobs) // (8 * processes))))
    counts = {split: sum(1 for *_, held in files if held == (split == "val")) for split in ("train", "val")}
    record |= {"files": counts, "classes": len(classes), "bytes": int(sum(written)), "processes": processes,
               "wall_s": round(time.monotonic() - t0, 1)}
    meta.write_text(json.dumps(record, indent=1))
    return {**record, "reused": False}


# ---------------------------------------------------------------------------------------------
# The runs
# ---------------------------------------------------------------------------------------------

def schedule(epochs: int) -> str:
    """The preset's steps (x0.2, x0.04, x0.008 at epochs 60, 120, 160 of 180) at the same fractions of ``epochs``."""
    return f"optim.steps=[[{epochs / 3:.4g}, 0.2], [{2 * epochs / 3:.4g}, 0.04], [{8 * epochs / 9:.4g}, 0.008]]"


def settings(args: argparse.Namespace, tree: Path, n_labeled: int) -> dict[str, list[str]]:
    """Each run's ``--set`` overrides of the ``imagenet_cowmix`` preset. Kept from the preset: SGD Nesterov, the LR
    rule (0.04 per 256 images), L2 2.5e-4 on kernels, the stepped schedule's shape, inception crop + flip + colour
    jitter, data.decode, the 10% rule, CowMix's p range and confidence rule. Set here: ResNet-50 (the preset's cheaper
    model); the crop (sigma scaled with it, linear in the side, as ``cowtune final`` scales it); one GPU's share of
    the paper's batch on 8 GPUs (128 + 128, the batch benchmarks/imagenet_pipeline.py measured); the schedule
    compressed to ``--epochs``; ``TEN_CLASS``; the eager step (compiling ResNet-50 takes minutes of a short run)."""
    lo, hi = (s * args.crop / PRESET_SIDE for s in (32.0, 128.0))
    common = [f"data.root={tree}", f"model={args.model}", f"data.image_size={args.crop}",
              f"data.n_labeled={n_labeled}", f"data.decode={args.decode}", f"data.workers={args.workers}",
              f"train.batch_size={args.batch}", f"train.eval_batch_size={args.eval_batch}",
              f"train.epochs={args.epochs}", schedule(args.epochs), f"mix.sigma_range=[{lo:.6g}, {hi:.6g}]",
              *TEN_CLASS, *EAGER, f"seed={args.seed}"]
    if args.steps_per_epoch:
        common.append(f"train.steps_per_epoch={args.steps_per_epoch}")
    if args.smoke:
        common += ["train.device=cpu", "train.threads=2"]
    return {"supervised": [*common, "mix=null", *args.set], "cowmix": [*common, *args.set]}


class OutOfTime(Exception):
    """Raised from the trainer's report after an epoch when the next one would end past the run's deadline."""


def curve(history: list[dict]) -> dict[str, list]:
    """Per epoch: teacher and student top-1 (and top-5, where the trainer reports it: over 10 classes) holdout error
    in %, the LR, the training images/s and the epoch's seconds."""
    pct = lambda h, k: None if h.get(k) is None else round(100 * h[k], 3)
    return {"epoch": [int(h["epoch"]) for h in history],
            **{f"{who}_top{k}": [pct(h, f"test/error{'' if k == 1 else '5'}_{who}") for h in history]
               for who in ("teacher", "student") for k in (1, 5)},
            "lr": [h["train/lr"] for h in history],
            "images_per_s": [round(h["train/images_per_s"], 1) for h in history],
            "train_s": [round(h["time/train_s"], 2) for h in history],
            "eval_s": [round(h["time/eval_s"], 2) for h in history]}


def run_one(name: str, overrides: list[str], work: Path, deadline: float, record: dict, save, log) -> None:
    """One run through ``fit`` into ``work/name``, its data prepared as ``fit`` would (to record the pipeline and the
    splits); ``record`` filled in after every epoch and ``save``d."""
    import torch

    from trainables.data import prepare_data
    from trainables.presets import load_config
    from trainables.trainer import fit, setup_device

    t0 = time.monotonic()
    cfg = load_config(PRESET, overrides)
    out = work / name
    device = setup_device(cfg)
    data = prepare_data(cfg.data, cfg.labeled_seed, device)   # as fit: its compile flag matters to small images only
    record.update({"method": cfg.method, "command": f"cowtune train {PRESET} --out {out} "
                   + " ".join(f"--set '{o}'" for o in overrides), "config": cfg.to_dict(),
                   "pipeline": data.describe(), "sizes": dict(data.sizes), "split_hashes": dict(data.split_hashes),
                   "device": str(device), "history": [], "epochs_done": 0, "stopped_by_budget": False})
    last = [time.monotonic()]

    def report(epoch: int, metrics: dict, _checkpoint: Path) -> None:
        record["history"].append({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
        record["curve"] = curve(record["history"])
        record["epochs_done"], record["wall_s"] = epoch, round(time.monotonic() - t0, 1)
        save()
        now = time.monotonic()
        took, last[0] = now - last[0], now
        if epoch < cfg.train.epochs and now + took > deadline:
            raise OutOfTime(f"{name}: stopped after epoch {epoch} of {cfg.train.epochs}: the next would end past the "
                            f"budget (an epoch took {took:.0f} s)")

    try:
        fit(cfg, out, report=report, data=data, log=log, restart=True)
    except OutOfTime as exc:
        record["stopped_by_budget"] = True
        log(str(exc))
    record["wall_s"] = round(time.monotonic() - t0, 1)
    save()
    del data
    gc.collect()   # the loader's workers and the GPU's memory go before the next run
    if device.type == "cuda":
        torch.cuda.empty_cache()


def summary(runs: dict) -> dict:
    """Each run's last and best teacher top-1 error (%), and CowMix's gain over supervised at the last epoch."""
    out = {}
    for name, r in runs.items():
        c = r.get("curve")
        if c and c["epoch"]:
            out[name] = {"epochs": c["epoch"][-1], "teacher_top1_last": c["teacher_top1"][-1],
                         "student_top1_last": c["student_top1"][-1], "teacher_top1_best": min(c["teacher_top1"])}
    if len(out) == 2 and out["supervised"]["epochs"] == out["cowmix"]["epochs"]:
        out["cowmix_gain_points"] = round(out["supervised"]["teacher_top1_last"] - out["cowmix"]["teacher_top1_last"],
                                          3)
    return out


# ---------------------------------------------------------------------------------------------
# The plot
# ---------------------------------------------------------------------------------------------

def plot(record: dict, png: Path) -> None:
    """Holdout top-1 error per epoch (teacher solid, student dashed) for both runs, and training images/s."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, speed) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    for (name, r), colour in zip(record["runs"].items(), ("tab:blue", "tab:red")):
        c = r.get("curve")
        if not c:
            continue
        ax.plot(c["epoch"], c["teacher_top1"], "-o", color=colour, ms=3, label=f"{name}, teacher")
        ax.plot(c["epoch"], c["student_top1"], "--", color=colour, alpha=0.7, label=f"{name}, student")
        speed.plot(c["epoch"], c["images_per_s"], "-o", color=colour, ms=3, label=name)
    ax.axhline(90, color="grey", lw=0.8, ls=":", label="chance (10 classes)")
    s, t = record["settings"], record["tree"]
    ax.set(xlabel="epoch", ylabel=f"top-1 error on the {t['files']['val']:,}-image holdout (%)", ylim=(0, 100))
    ax.set_title(f"CIFAR-10 JPEGs at {t['side']} px, {s['model']} {s['crop']} px crops, {s['n_labeled']:,} labels",
                 fontsize=10)
    speed.set(xlabel="epoch", ylabel="training images/s (CowMix: labeled + unlabeled)")
    speed.set_ylim(bottom=0)
    for a in (ax, speed):
        a.grid(True, alpha=0.3)
        if a.get_legend_handles_labels()[0]:   # a run that failed before its first epoch has no curve
            a.legend(fontsize=8)
    m = record["machine"]
    fig.suptitle(f"{m['gpu']}, torch {m['torch']}, {m['commit']}, {m['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help=f"writes {JSON_NAME}, {LOG_NAME} and {PNG_NAME} here")
    p.add_argument("--smoke", action="store_true",
                   help="CPU: 12 images a class at 48 px, cnn_tiny at 32, 2 epochs of 4 steps")
    p.add_argument("--data", default=str(ROOT / ".devdata" / "train.zip"), help="the CIFAR-10 JPEG zip")
    p.add_argument("--tree", help="where the tree is made (reused); default /tmp/cowtune-cifar10-<side>")
    p.add_argument("--work", help="the runs' folders (checkpoints); default /tmp/cowtune-large-image")
    p.add_argument("--side", type=int, default=128, help="the tree's images, px (upsampled bicubically from 32)")
    p.add_argument("--quality", type=int, default=90, help="the tree's JPEG quality")
    p.add_argument("--crop", type=int, help="data.image_size, the training crop and the eval size (default: --side)")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch", type=int, default=128, help="labeled images a step (as many unlabeled)")
    p.add_argument("--eval-batch", type=int, default=500)
    p.add_argument("--steps-per-epoch", type=int, help="default: the training split // --batch (351)")
    p.add_argument("--decode", default="auto", choices=("auto", "pil", "device", "hybrid"))
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="data.workers (default: every core)")
    p.add_argument("--seed", type=int, default=0, help="the run seed: weights, order, the labeled subset")
    p.add_argument("--budget-s", type=float, default=450, help="the whole command's seconds, at most (see above)")
    p.add_argument("--runs", default=",".join(RUNS), help="which runs, in this order")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override of both runs")
    args = p.parse_args(argv)
    unknown = sorted(set(args.runs.split(",")) - set(RUNS))
    if unknown:
        p.error(f"--runs: unknown run {', '.join(unknown)} (known: {', '.join(RUNS)})")
    out = Path(args.out)
    if args.smoke:
        args.side, args.model, args.epochs, args.batch, args.eval_batch = 48, "cnn_tiny", 2, 8, 10
        args.workers, args.crop = min(2, args.workers or 1), args.crop or 32
        args.steps_per_epoch = args.steps_per_epoch or 4
        args.tree, args.work = args.tree or str(out / "smoke-tree"), args.work or str(out / "smoke-runs")
    args.crop = args.crop or args.side
    args.tree = args.tree or f"/tmp/cowtune-cifar10-{args.side}"
    args.work = args.work or "/tmp/cowtune-large-image"
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plot"]:
        p = argparse.ArgumentParser(prog="large_image_learning.py plot", description="the PNG of a JSON")
        p.add_argument("json")
        p.add_argument("--out", required=True, help="the PNG")
        a = p.parse_args(argv[1:])
        plot(json.loads(Path(a.json).read_text()), Path(a.out))
        print(f"wrote {a.out}")
        return 0
    args = parse(argv)
    t0 = time.monotonic()
    end = t0 + args.budget_s
    out, work, tree = Path(args.out), Path(args.work), Path(args.tree)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    logfile = open(out / LOG_NAME, "w")

    def log(line: str) -> None:
        print(line, flush=True)
        logfile.write(line + "\n")
        logfile.flush()

    made = make_tree(Path(args.data), tree, args.side, args.quality, 12 if args.smoke else None,
                     20 if args.smoke else HOLDOUT, 2 if args.smoke else (os.cpu_count() or 1))
    log(f"tree {tree}: {made['files']['train']:,} + {made['files']['val']:,} JPEGs of {made['side']} px, "
        f"{made['bytes'] / 2 ** 20:.0f} MB, " + ("reused" if made["reused"] else f"made in {made['wall_s']} s"))
    n_labeled = max(made["classes"], made["files"]["train"] // 10)   # the preset's rule: 10% (floor), per class
    sets = settings(args, tree, n_labeled)
    env = environment("cpu" if args.smoke else ("cuda" if _cuda() else "cpu"))
    record = {"experiment": "large_image_learning", "machine": env, "tree": made,
              "settings": {"preset": PRESET, "model": args.model, "side": args.side, "crop": args.crop,
                           "epochs": args.epochs, "batch": args.batch, "n_labeled": n_labeled,
                           "decode": args.decode, "workers": args.workers, "seed": args.seed,
                           "budget_s": args.budget_s, "overrides": sets},
              "runs": {}, "summary": {}}

    def save() -> None:
        record["summary"] = summary(record["runs"])
        record["wall_s"] = round(time.monotonic() - t0, 1)
        tmp = out / f".{JSON_NAME}.tmp"
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, out / JSON_NAME)

    names = args.runs.split(",")
    for k, name in enumerate(names):
        left = end - time.monotonic()
        share = COST[name] / sum(COST[n] for n in names[k:])   # of what is left, by the runs still to come
        log(f"--- {name}: cowtune train {PRESET} " + " ".join(f"--set {o}" for o in sets[name]))
        record["runs"][name] = {}
        try:
            run_one(name, sets[name], work, time.monotonic() + share * left, record["runs"][name], save, log)
        except Exception as exc:   # noqa: BLE001 - kept in the JSON; the other run still gets its turn on the lease
            record["runs"][name]["error"] = "".join(traceback.format_exception(exc)[-12:])
            log(f"{name} failed: {type(exc).__name__}: {exc}")
    save()
    failed = [n for n, r in record["runs"].items() if "error" in r]
    log(f"done in {record['wall_s']} s: {json.dumps(record['summary'])}"
        + (f"; failed: {', '.join(failed)} (the JSON has the traceback)" if failed else ""))
    try:
        plot(record, out / PNG_NAME)
        log(f"wrote {out / PNG_NAME}")
    except ImportError:
        log(f"no matplotlib here: draw it elsewhere, python3 {Path(__file__).name} plot {out / JSON_NAME} --out X.png")
    except Exception as exc:   # noqa: BLE001 - the JSON is written; the plot can be drawn again from it
        log(f"the plot failed ({type(exc).__name__}: {exc}): python3 {Path(__file__).name} plot {out / JSON_NAME}")
    logfile.close()
    return 1 if failed else 0


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
