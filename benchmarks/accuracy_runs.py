"""Accuracy runs packed on one GPU: launch several ``cowtune train`` runs at once, watch them, collect their curves.

A GPU lease here lasts at most 30 minutes and nothing on the machine survives it, so a plan's runs start
together in the background (their own process sessions) and a watcher, called again from back-to-back device
calls, prints one table of where each run is and writes every run's per-epoch metrics into one JSON file:

    python benchmarks/accuracy_runs.py launch --plan wrn28_2_paths --data .devdata/train.zip --dir /tmp/acc
    python benchmarks/accuracy_runs.py watch --dir /tmp/acc --out $OUT --seconds 540
    python benchmarks/accuracy_runs.py plot $OUT/curves.json --out docs/results/wrn28_2_paths.png   # here

Each run is a plain ``cowtune train`` command (``commands.txt`` in the run folder lists them), so any number in
docs/RESULTS.md can be reproduced one run at a time as well. With ``--world N`` each run is instead one
``benchmarks/data_parallel_epoch.py`` command, the run split over N local GPUs (the 27M model's runs):

    python benchmarks/accuracy_runs.py launch --plan ss96_300 --only ceiling_s0 --world 2 --data .devdata/train.zip \
        --dir /tmp/acc

With ``--gpus 0,1`` the one-GPU runs are dealt round-robin over those GPUs (each run's ``CUDA_VISIBLE_DEVICES``),
one launch folder and one watcher for them all.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script from anywhere: the repo's packages

# The search's proxy for the paper's setting: CIFAR-10 JPEGs, 1,000 labels, the 5,000-image holdout.
HOLDOUT = ["data.dataset=imagefolder", "data.n_val=5000", "data.eval_split=val", "data.n_labeled=1000"]
# The fast path off (trainables.config.PLAIN_FAST): eager float32 (TF32 convolutions, as PyTorch's default), one
# student call per batch, cuDNN for every convolution, no CUDA graph, no side streams, NCHW. (The plans run before
# train.fast existed spelled these out one by one: train.compile=false train.cuda_graph=none ...)
PLAIN = ["train.fast=false"]
SUPERVISED = ["mix=null", "perturb=null"]


def _schedule(epochs: int) -> list[str]:
    """The paper's stepped schedule (x0.2 at 40%, x0.04 at 80% of 300 epochs) compressed to ``epochs``."""
    return [f"train.epochs={epochs}", f"optim.steps=[[{0.4 * epochs:g}, 0.2], [{0.8 * epochs:g}, 0.04]]"]


def _plan_wrn28_2_paths(epochs: int) -> dict[str, list[str]]:
    """Fast path against the plain path (and float32 alone) on WRN-28-2 CowMix; a supervised baseline."""
    base = ["model=wrn28_2", *HOLDOUT, *_schedule(epochs)]
    return {
        "fast_s0": [*base, "seed=0"], "fast_s1": [*base, "seed=1"], "fast_s2": [*base, "seed=2"],
        "plain_s0": [*base, "seed=0", *PLAIN], "plain_s1": [*base, "seed=1", *PLAIN],
        "fast_fp32_s0": [*base, "seed=0", "train.fast.precision=fp32"],
        "supervised_s0": [*base, "seed=0", *SUPERVISED],
        "fast_bn32_s0": [*base, "seed=0", "train.bn_batch=32"], "fast_bn32_s1": [*base, "seed=1", "train.bn_batch=32"],
    }


def _plan_wrn28_2_bn_batch(epochs: int) -> dict[str, list[str]]:
    """Ghost batch norm on WRN-28-2 CowMix (fast path): 32 (the reference's 8-device pmap) on more seeds, and 64."""
    base = ["model=wrn28_2", *HOLDOUT, *_schedule(epochs), "train.fast.tune_kernels=false"]
    return {"fast_bn32_s1": [*base, "seed=1", "train.bn_batch=32"],
            "fast_bn32_s2": [*base, "seed=2", "train.bn_batch=32"],
            "fast_bn64_s0": [*base, "seed=0", "train.bn_batch=64"]}


FAST = ["train.fast.tune_kernels=false", "train.bn_batch=32"]   # the paper presets' ghost BN; no kernel tuning
FP32 = ["train.fast.precision=fp32"]


def _plan_wrn28_2_full(epochs: int) -> dict[str, list[str]]:
    """WRN-28-2 CowMix at the paper's length with ghost BN, bf16 and float32 (target: 9% on the holdout)."""
    base = ["model=wrn28_2", *HOLDOUT, *_schedule(epochs), *FAST]
    return {"bn32_s0": [*base, "seed=0"], "bn32_fp32_s0": [*base, "seed=0", *FP32]}


def _plan_wrn28_2_precision(epochs: int) -> dict[str, list[str]]:
    """Float32 against bf16 on more seeds (seeds 1 and 2 of bf16 are in docs/results already)."""
    base = ["model=wrn28_2", *HOLDOUT, *_schedule(epochs), *FAST]
    return {"bn32_fp32_s1": [*base, "seed=1", *FP32], "bn32_fp32_s2": [*base, "seed=2", *FP32],
            "bn32_s3": [*base, "seed=3"], "bn32_fp32_s3": [*base, "seed=3", *FP32]}


def _plan_wrn28_2_jpeg(epochs: int) -> dict[str, list[str]]:
    """The data's dose-response: the same run on the zip re-encoded at quality 50 and 30 (make them first with
    benchmarks/reencode_jpeg.py into /tmp/cowtune-q50.zip and /tmp/cowtune-q30.zip); quality 75 is seed 0 of the
    other plans."""
    base = ["model=wrn28_2", *HOLDOUT, *_schedule(epochs), *FAST]
    return {f"q{q}_s0": [*base, "seed=0", f"data.root=/tmp/cowtune-q{q}.zip"] for q in (50, 30)}


def _plan_shakeshake(epochs: int) -> dict[str, list[str]]:
    """The paper's model on the compressed 120-epoch schedule with ghost BN (target: 7% on the holdout)."""
    return {"ss96_bn32_s0": ["model=wrn26_6_shakeshake", *HOLDOUT, *_schedule(epochs), *FAST, "seed=0"]}


def _plan_sanity(epochs: int) -> dict[str, list[str]]:
    """The data pipeline's ceiling: supervised WRN-28-2 on every training label (45,000; the paper's "ALL" column
    is 3.57% for the 27M model, WRN-28-2 usually 5-6%), beside supervised at 1,000 labels. If all labels do not
    reach about 6%, the plateau of the semi-supervised runs near 15% is in the data or the model, not the method."""
    base = ["model=wrn28_2", *HOLDOUT, *_schedule(epochs), *FAST, *SUPERVISED, "seed=0"]
    return {"sup_all_s0": [*base, "data.n_labeled=45000"], "sup_1000_s0": base}


def _plan_ceiling(epochs: int) -> dict[str, list[str]]:
    """How low a fully supervised run gets on these JPEGs (WRN-28-2 on all 45,000 labels was 10.5% at 60 epochs,
    and a from-scratch pipeline agreed): at 300 epochs (the schedule's share), at JPEG quality 50 and 30 (the data's
    share, a low-noise dose-response; make the zips first with benchmarks/reencode_jpeg.py into
    /tmp/cowtune-q50.zip and /tmp/cowtune-q30.zip), and the 27M shake-shake on the 120-epoch schedule (the
    ceiling under the 7% target). Each run has its own length; ``epochs`` is unused."""
    sup_all = [*HOLDOUT, *FAST, *SUPERVISED, "seed=0", "data.n_labeled=45000"]
    return {"sup_all_300": ["model=wrn28_2", *sup_all, *_schedule(300)],
            **{f"sup_all_q{q}_60": ["model=wrn28_2", *sup_all, *_schedule(60), f"data.root=/tmp/cowtune-q{q}.zip"]
               for q in (50, 30)},
            "ss_sup_all_120": ["model=wrn26_6_shakeshake", *sup_all, *_schedule(120)]}


def _plan_wrn28_2_stabilisers(epochs: int) -> dict[str, list[str]]:
    """Against the rise in error after the first LR drop at 300 epochs (15.5% fp32 seed 0 without these): the
    teacher's (1 - alpha) scaled by the LR schedule (the reference's anneal_teacher_alpha), and 5 warm-up epochs."""
    base = ["model=wrn28_2", *HOLDOUT, *_schedule(epochs), *FAST, *FP32, "seed=0"]
    return {"anneal_fp32_s0": [*base, "teacher.anneal=true"], "warmup5_fp32_s0": [*base, "optim.warmup_epochs=5"]}


MEAN_TEACHER = "perturb={name: mean_teacher, weight: 1.0, conf_thresh: 0.97, conf_avg: false}"   # on cifar10_cowout


def _plan_paper_order(epochs: int) -> dict[str, list[str]]:
    """The paper's order at 1,000 labels on WRN-28-2 (CowMix < CowOut < Mean Teacher < supervised), ghost BN 32:
    CowOut and Mean Teacher from their presets' settings (teacher alpha 0.99, the erasure path)."""
    base = ["model=wrn28_2", *HOLDOUT, *_schedule(epochs), *FAST, "seed=0"]
    return {"cowout_s0": ["config=cifar10_cowout", *base],
            "mt_s0": ["config=cifar10_cowout", *base, MEAN_TEACHER]}


CUTMIX = "mix={name: cutmix, weight: 30.0, conf_thresh: 0.6, conf_avg: true, conf_mode: mix_conf}"   # cifar10_cowmix
RANDERASE = "perturb={name: randerase, noise_std: 1.0, weight: 1.0, conf_thresh: 0.97, conf_avg: false}"  # cowout


def _plan_box_methods(epochs: int) -> dict[str, list[str]]:
    """The paper's box baselines beside their CowMask counterparts (CutMix beside CowMix, RandErase beside CowOut),
    each on its preset with only the mask changed, as in the paper's Table 1."""
    base = ["model=wrn28_2", *HOLDOUT, *_schedule(epochs), *FAST, "seed=0"]
    return {"cutmix_s0": [*base, CUTMIX], "randerase_s0": ["config=cifar10_cowout", *base, RANDERASE]}


def _plan_labels_4000(epochs: int) -> dict[str, list[str]]:
    """CowMix with 4,000 labels at the paper's length (paper, 27M model: 3.61%), beside supervised at 1,000 labels
    at the same length (the bottom of the paper's order)."""
    base = ["model=wrn28_2", *HOLDOUT, *_schedule(epochs), *FAST, "seed=0"]
    return {"cowmix_4000_s0": [*base, "data.n_labeled=4000"], "sup_1000_s0": [*base, *SUPERVISED]}


def _plan_mix_gate(epochs: int) -> dict[str, list[str]]:
    """Why CowMix does not beat CowOut on WRN-28-2 at 300 epochs (15.5-22.2% against 15.6%; the paper: 4.73 against
    8.98%): CowMix's 0.6 confidence gate passes 99% of unlabeled images late in training, CowOut's 0.97 gate 82%.
    A stricter gate and slower teachers, on the two seeds measured with the preset (0: 22.16%, 3: 15.78%)."""
    base = ["model=wrn28_2", *HOLDOUT, *_schedule(epochs), *FAST]
    return {f"{name}_s{seed}": [*base, f"seed={seed}", *sets] for seed in (0, 3)
            for name, sets in (("conf97", ["mix.conf_thresh=0.97"]), ("alpha99", ["teacher.alpha=0.99"]),
                               ("alpha995", ["teacher.alpha=0.995"]))}


def _plan_ss96_300(epochs: int) -> dict[str, list[str]]:
    """The paper's 27M model at its length (launch with --world 2: one run at a time fits a 30-minute lease): every
    label, the ceiling that CowMix's 1,000-label error (11.08% at epoch 256, seed 0) is a ratio of; CowMix on a second
    seed."""
    base = ["model=wrn26_6_shakeshake", *HOLDOUT, *_schedule(epochs), *FAST]
    return {"ceiling_s0": [*base, *SUPERVISED, "data.n_labeled=45000", "seed=0"], "cowmix_s1": [*base, "seed=1"]}


def _plan_ss96_jpeg(epochs: int) -> dict[str, list[str]]:
    """Does the data hurt CowMix more than CowOut? The paper's model on the zip as given (quality 75) and re-encoded
    at quality 30 (make it first: benchmarks/reencode_jpeg.py .devdata/train.zip /tmp/cowtune-q30.zip --quality 30),
    supervised on every label, CowMix and CowOut: if CowMix's excess over the ceiling grows with the loss faster than
    CowOut's, the JPEGs explain part of CowMix's excess (docs/journal/2026-11-30.md). CutMix too:
    does box mixing pay the data's cost as CowMix does (it ends behind CowOut on WRN-28-2)?"""
    base = ["model=wrn26_6_shakeshake", *HOLDOUT, *_schedule(epochs), *FAST, "seed=0"]
    runs = {"sup": [*base, *SUPERVISED, "data.n_labeled=45000"], "cowmix": base,
            "cowout": ["config=cifar10_cowout", *base], "cutmix": [*base, CUTMIX]}
    q30 = ["data.root=/tmp/cowtune-q30.zip"]
    return {f"{name}_{q}": overrides + (q30 if q == "q30" else []) for name, overrides in runs.items()
            for q in ("q75", "q30")}


def _plan_wrn28_2_noise(epochs: int) -> dict[str, list[str]]:
    """How noisy one search trial is and how well short trials rank long ones (issue 53's first step): the paper's
    WRN-28-2 CowMix recipe on four seeds, and seven variants aimed at where its noise lives (the early bimodal
    start: LR warm-up, a lower LR, a smaller omega; the late drift as the LR drops: a stricter gate, a slower or
    annealed teacher) on two seeds each (the three together, "steady", on four). Seeds pair the runs: seed N is the same labeled subset, initialisation and
    data order in every config."""
    base = ["model=wrn28_2", *HOLDOUT, *_schedule(epochs), *FAST]
    variants = {"paper": [], "warmup5": ["optim.warmup_epochs=5"], "lr02": ["optim.lr_per_256=0.02"],
                "w10": ["mix.weight=10"], "conf8": ["mix.conf_thresh=0.8"], "alpha99": ["teacher.alpha=0.99"],
                "anneal": ["teacher.anneal=true"],
                "steady": ["optim.warmup_epochs=5", "teacher.anneal=true", "mix.conf_thresh=0.8"]}
    return {f"{name}_s{seed}": [*base, f"seed={seed}", *sets] for name, sets in variants.items()
            for seed in ((0, 1, 2, 3) if name in ("paper", "steady") else (0, 1))}


def _plan_wrn28_2_noise_more(epochs: int) -> dict[str, list[str]]:
    """Four more paired seeds (4-7) of the paper's recipe and of "steady" from ``wrn28_2_noise``: with eight pairs
    the paired test can tell a 1-point gain from the seed noise."""
    base = ["model=wrn28_2", *HOLDOUT, *_schedule(epochs), *FAST]
    variants = {"paper": [], "steady": ["optim.warmup_epochs=5", "teacher.anneal=true", "mix.conf_thresh=0.8"]}
    return {f"{name}_s{seed}": [*base, f"seed={seed}", *sets] for name, sets in variants.items() for seed in (4, 5, 6, 7)}


PROMOTED_WRN28_2 = Path(__file__).resolve().parents[1] / "docs" / "results" / "promoted-wrn28_2-cowmix-1000.yaml"


def _plan_wrn28_2_steady_300(epochs: int) -> dict[str, list[str]]:
    """Issue 53's last test: the config the search promoted ("steady", its trial 2: 24.17 +- 1.46% against the
    paper's 25.42 +- 2.79% over the confirm stage's 8 paired seeds at 60 epochs), read from its promoted YAML,
    against the paper's recipe at the full 300 epochs, on the confirm stage's seeds 1-3. Three runs fit one lease:
    ``--only paper_s1,steady_s1,paper_s2`` then the other three."""
    base = ["model=wrn28_2", *HOLDOUT, *_schedule(epochs), *FAST]
    variants = {"paper": [], "steady": [f"config={PROMOTED_WRN28_2}"]}
    return {f"{name}_s{seed}": [*sets, *base, f"seed={seed}"] for seed in (1, 2, 3) for name, sets in variants.items()}


PLANS = {"mix_gate": (_plan_mix_gate, 300), "ss96_300": (_plan_ss96_300, 300), "ss96_jpeg": (_plan_ss96_jpeg, 60),
         "box_methods": (_plan_box_methods, 300),
         "labels_4000": (_plan_labels_4000, 300), "sanity": (_plan_sanity, 60), "ceiling": (_plan_ceiling, 0),
         "paper_order": (_plan_paper_order, 300),
         "wrn28_2_stabilisers": (_plan_wrn28_2_stabilisers, 300), "wrn28_2_paths": (_plan_wrn28_2_paths, 60),
         "wrn28_2_bn_batch": (_plan_wrn28_2_bn_batch, 60),
         "wrn28_2_full": (_plan_wrn28_2_full, 300), "wrn28_2_precision": (_plan_wrn28_2_precision, 60),
         "wrn28_2_jpeg": (_plan_wrn28_2_jpeg, 60), "shakeshake": (_plan_shakeshake, 120),
         "wrn28_2_noise": (_plan_wrn28_2_noise, 60), "wrn28_2_noise_more": (_plan_wrn28_2_noise_more, 60),
         "wrn28_2_steady_300": (_plan_wrn28_2_steady_300, 300)}


def run_settings(overrides: list[str], config: str, data: str, extra: list[str] = ()) -> tuple[str, list[str]]:
    """A plan run's preset (its own ``config=...`` if it names one, else ``config``) and its ``--set`` overrides:
    the data first, then the run's, then those added to every run."""
    preset = next((o.split("=", 1)[1] for o in overrides if o.startswith("config=")), config)
    return preset, [f"data.root={data}", *(o for o in overrides if not o.startswith("config=")), *extra]


def place_on_gpus(names: list[str], gpus: str | None) -> dict[str, str | None]:
    """Each run's ``CUDA_VISIBLE_DEVICES`` for ``--gpus 0,1``: the runs dealt round-robin over the GPUs in the
    plan's order (None: every run sees every GPU)."""
    if not gpus:
        return {name: None for name in names}
    ids = gpus.split(",")
    if not all(i.strip().isdigit() for i in ids):
        raise SystemExit(f"--gpus {gpus!r}: expected comma-separated GPU indices, e.g. 0,1")
    return {name: ids[k % len(ids)].strip() for k, name in enumerate(names)}


def launch(args: argparse.Namespace) -> None:
    builder, default_epochs = PLANS[args.plan]
    runs = builder(args.epochs or default_epochs)
    if args.only:
        only = args.only.split(",")
        unknown = sorted(set(only) - set(runs))
        if unknown:
            raise SystemExit(f"--only: no run {', '.join(unknown)} in plan {args.plan} (it has {', '.join(runs)})")
        runs = {k: v for k, v in runs.items() if k in only}
    if args.gpus and args.world > 1:
        raise SystemExit("--gpus deals one-GPU runs out over GPUs; a --world run uses every GPU it sees")
    gpu = place_on_gpus(list(runs), args.gpus)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    data = str(Path(args.data).resolve())
    lines = []
    for name, overrides in runs.items():
        config, sets = run_settings(overrides, args.config, data, args.set)
        if args.world > 1:   # the whole run (its train.epochs), its state written once at the end (320 MB at 27M)
            from trainables.presets import load_config
            epochs = load_config(config, sets).train.epochs
            cmd = [sys.executable, str(Path(__file__).with_name("data_parallel_epoch.py")), config, "--world",
                   str(args.world), "--epochs", str(epochs), "--save-every", str(epochs), "--out", str(root / name)]
        else:
            cmd = [sys.executable, "-m", "trainables.cli", "train", config, "--out", str(root / name)]
        cmd += [a for o in sets for a in ("--set", o)]
        log = open(root / f"{name}.log", "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"CUDA_VISIBLE_DEVICES": gpu[name]} if gpu[name] else {})}
        subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        how = f"data_parallel_epoch.py --world {args.world}" if args.world > 1 else "cowtune train"
        how = f"CUDA_VISIBLE_DEVICES={gpu[name]} {how}" if gpu[name] else how
        lines.append(f"{name}: {how} {config} " + " ".join(f"--set {o}" for o in run_settings(
            overrides, args.config, args.data, args.set)[1]))
    (root / "commands.txt").write_text("\n".join(lines) + "\n")
    (root / "plan.json").write_text(json.dumps({"plan": args.plan, "runs": runs, "started": _now()}, indent=1))
    print(f"launched {len(runs)} runs of {args.plan} in {root}")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _machine() -> dict[str, str]:
    out = {"date": _now()}
    try:
        import torch
        out["torch"] = torch.__version__
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       check=False).stdout.strip()
    except OSError:
        pass
    return out


def collect(root: Path) -> dict:
    plan = json.loads((root / "plan.json").read_text())
    runs = {}
    for name in plan["runs"]:
        path = root / name / "metrics.jsonl"
        history = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        log = (root / f"{name}.log").read_text(errors="replace").splitlines() if (root / f"{name}.log").exists() else []
        runs[name] = {"overrides": plan["runs"][name], "history": history, "log_tail": log[-6:],
                      "done": any((root / name / f).exists() for f in ("result.json", "summary.json"))}
    return {"plan": plan["plan"], "started": plan["started"], "machine": _machine(),
            "commands": (root / "commands.txt").read_text(), "runs": runs}


def _err(h: dict, who: str) -> float | None:
    key = next((k for k in (f"val/error_{who}", f"test/error_{who}") if k in h), None)
    return None if key is None else 100 * h[key]


def table(curves: dict) -> str:
    rows = [f"{'run':<16} {'epoch':>7} {'teacher':>8} {'student':>8} {'best T':>7} {'steps/s':>8}  state"]
    for name, r in curves["runs"].items():
        h = r["history"]
        if not h:
            state = r["log_tail"][-1][:60] if r["log_tail"] else "no log"
            rows.append(f"{name:<16} {'-':>7} {'':>8} {'':>8} {'':>7} {'':>8}  {state}")
            continue
        last = h[-1]
        best = min(_err(x, "teacher") for x in h)
        epochs = json.loads(json.dumps(r["overrides"]))
        total = next((o.split("=")[1] for o in epochs if o.startswith("train.epochs=")), "?")
        rows.append(f"{name:<16} {int(last['epoch']):>3}/{total:<3} {_err(last, 'teacher'):>7.2f}% "
                    f"{_err(last, 'student'):>7.2f}% {best:>6.2f}% {last.get('train/steps_per_s', 0):>8.1f}  "
                    + ("done" if r["done"] else "running"))
    return "\n".join(rows)


def watch(args: argparse.Namespace) -> None:
    root, out = Path(args.dir), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_end = time.monotonic() + args.seconds
    while True:
        curves = collect(root)
        (out / "curves.json").write_text(json.dumps(curves))
        done = all(r["done"] for r in curves["runs"].values())
        print(f"--- {_now()}\n{table(curves)}", flush=True)
        if done or time.monotonic() + args.every > t_end:
            break
        time.sleep(args.every)
    logs = "\n\n".join(f"== {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-40:])
                       for p in sorted(root.glob("*.log")))
    (out / "logs.txt").write_text(logs)


def plot(args: argparse.Namespace) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = [json.loads(Path(f).read_text()) for f in args.curves]
    curves = files[0]
    runs = {name: r for c in files for name, r in c["runs"].items()}
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in sorted(runs.items()):
        h = r["history"]
        if h and (not args.runs or name in args.runs.split(",")):
            style = "--" if "plain" in name else ":" if "supervised" in name else "-"
            ax.plot([x["epoch"] for x in h], [_err(x, "teacher") for x in h], style, label=name)
    ax.set_xlabel("epoch")
    ax.set_ylabel("teacher error on the holdout (%)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    m = curves["machine"]
    ax.set_title(args.title or f"{curves['plan']}: {m.get('gpu', 'cpu')}, {m['date'][:10]}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(required=True)
    p = sub.add_parser("launch", help="start a plan's runs in the background")
    p.add_argument("--plan", required=True, choices=sorted(PLANS))
    p.add_argument("--data", required=True, help="the CIFAR-10 JPEG zip (or ImageFolder tree)")
    p.add_argument("--dir", required=True, help="where the runs write")
    p.add_argument("--config", default="cifar10_cowmix", help="preset or YAML the overrides apply to")
    p.add_argument("--epochs", type=int, help="schedule length (default: the plan's)")
    p.add_argument("--only", help="comma-separated run names of the plan")
    p.add_argument("--set", action="append", default=[], help="an override added to every run")
    p.add_argument("--world", type=int, default=1, help="GPUs each run is split over (data-parallel; default 1)")
    p.add_argument("--gpus", help="deal the runs round-robin over these GPUs, e.g. 0,1 (default: all on the first)")
    p.set_defaults(func=launch)
    p = sub.add_parser("watch", help="print a table every --every s until done or --seconds pass; write curves")
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, default=540)
    p.add_argument("--every", type=float, default=60)
    p.set_defaults(func=watch)
    p = sub.add_parser("plot", help="learning curves of a curves.json as a PNG")
    p.add_argument("curves", nargs="+", help="one or more curves.json (their runs drawn together)")
    p.add_argument("--out", required=True)
    p.add_argument("--runs", help="comma-separated run names to draw (default: all)")
    p.add_argument("--title")
    p.set_defaults(func=plot)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
