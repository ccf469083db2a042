"""``cowtune final``: the promoted config x datasets x label counts x 5 labeled subsets, on the test split.

One Ray Tune experiment (a grid of full configs, no search) under one MLflow parent run; each run
trains on all training images (``n_val=0``) with labeled subset ``seed`` and reports the teacher's
test error. The paper-style table (mean +- std over seeds per dataset and label count, next to a
supervised-only run of the same seeds and the paper's numbers) is printed and saved.
ImageNet: ResNet-152, 10% labels, CowMask sigma scaled with the image size as in the paper
((4, 16) at 32 px <-> (32, 128) at 224 px).
"""
from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path
from typing import Any

from trainables.config import DataConfig, TrainConfig
from trainables.data import check_source
from trainables.data.sources import has_test_split
from trainables.presets import apply_overrides
from trainables.trainer import check_names
from trainables.validation import ConfigError, check, flatten

# Paper tables (test error %, mean, std over 5 runs); -1 = all labels; ImageNet: top-1 with 10% labels.
PAPER: dict[str, dict[int, dict[str, tuple[float, float | None]]]] = {
    "cifar10": {n: {"supervised": s, "cowout": o, "cowmix": m} for n, s, o, m in [
        (50, (76.01, 1.53), (72.55, 3.80), (55.46, 15.23)), (100, (69.74, 2.09), (56.72, 3.90), (23.00, 3.95)),
        (250, (58.41, 1.60), (28.45, 7.03), (7.56, 0.94)), (500, (47.12, 1.78), (14.00, 1.84), (5.34, 0.80)),
        (1000, (36.61, 1.11), (8.98, 1.11), (4.73, 0.37)), (2000, (24.53, 0.80), (6.27, 0.40), (4.13, 0.16)),
        (4000, (14.81, 0.43), (4.97, 0.12), (3.61, 0.07)), (-1, (3.57, 0.09), (2.50, 0.10), (2.56, 0.06))]},
    "cifar100": {n: {"supervised": s, "cowout": o, "cowmix": m} for n, s, o, m in [
        (1000, (78.80, 0.22), (68.86, 0.78), (57.27, 1.34)), (5000, (49.24, 0.40), (38.82, 0.44), (29.25, 0.47)),
        (10000, (36.04, 0.26), (27.54, 0.29), (23.61, 0.30)), (-1, (18.82, 0.22), (16.46, 0.22), (15.73, 0.15))]},
    "svhn": {n: {"supervised": s, "cowout": o, "cowmix": m} for n, s, o, m in [
        (100, (71.24, 5.40), (66.66, 19.71), (9.73, 4.01)), (250, (37.02, 6.15), (12.11, 1.82), (3.59, 0.30)),
        (500, (18.85, 1.49), (5.94, 0.38), (3.80, 0.32)), (1000, (11.71, 0.55), (4.36, 0.29), (3.72, 0.60)),
        (2000, (8.23, 0.38), (3.59, 0.25), (3.13, 0.11)), (4000, (6.01, 0.46), (3.04, 0.04), (2.90, 0.19)),
        (-1, (2.82, 0.08), (2.42, 0.09), (2.18, 0.06))]},
    "imagenet": {-10: {"supervised": (42.91, None), "cowmix": (26.06, 0.17)}},
}
IMAGENET_LABELS = -10          # marker: 10% of the training images
IMAGENET = {"model": "resnet152", "data": {"dataset": "imagefolder", "image_size": 224, "colour_jitter": True}}


def imagenet_sigma_scale(image_size: int) -> float:
    """The paper's (4, 16) at 32 px becomes (32, 128) at 224 px: 8x at 224, linear in the side."""
    return 8.0 * image_size / 224.0


def _count_train_images(data: dict[str, Any], check_data: bool) -> int:
    """The training images of an ImageFolder tree, listed once on the driver (not decoded)."""
    check(check_data, "--labels", "be given for imagenet with --skip-data-check (10% of the training images, the "
          "default, is counted on this machine)", None)
    return check_source(DataConfig(**{k: v for k, v in data.items() if k in ("dataset", "root", "image_size")}))


def final_configs(promoted: dict[str, Any], datasets: dict[str, str], labels: list[int] | None, seeds: int,
                  supervised: bool, overrides: list[str], check_data: bool = True) -> list[dict[str, Any]]:
    """One full config per (dataset, label count, method, seed); all checked before Ray starts, each dataset's
    files too (listed, not decoded) unless ``check_data`` is off, where only the workers hold them."""
    check(seeds >= 1, "--seeds", "be >= 1", seeds)
    promoted = TrainConfig.from_dict(promoted).to_dict()   # checked, and every section there (a hand-written one too)
    out = []
    for name, root in datasets.items():
        known = PAPER.get(name)
        counts = labels or (sorted(known) if known else None)
        if counts is None:
            raise ConfigError(f"--labels is required for dataset '{name}' (no paper label counts). Known: {', '.join(PAPER)}")
        n_train = None   # ImageNet's 10% labels: its training images, counted once
        first = len(out)
        for n in counts:
            for method in ("promoted", "supervised") if supervised else ("promoted",):
                for seed in range(seeds):
                    d = copy.deepcopy(promoted)
                    if name == "imagenet":
                        d = {**d, "model": IMAGENET["model"], "data": {**d["data"], **IMAGENET["data"]}}
                        for key in ("mix", "perturb"):
                            if d.get(key) and "sigma_range" in d[key]:
                                f = imagenet_sigma_scale(d["data"]["image_size"])
                                d[key]["sigma_range"] = [s * f for s in d[key]["sigma_range"]]
                    d["seed"] = seed
                    d["data"].update(root=root, n_val=0, eval_split="test", labeled_seed=seed, n_labeled=n)
                    if name != "imagenet":
                        d["data"]["dataset"] = name
                    elif n == IMAGENET_LABELS:
                        n_train = n_train or _count_train_images(d["data"], check_data)
                        d["data"]["n_labeled"] = max(1, round(0.1 * n_train))
                    if method == "supervised":
                        d["mix"] = d["perturb"] = None
                    d = apply_overrides(d, overrides)
                    cfg = TrainConfig.from_dict(d)
                    if len(out) == first:   # a dataset's first run: its names, and its files listed (once counted)
                        check_names(cfg)
                        if check_data and n_train is None:
                            check_source(cfg.data)
                        if check_data and cfg.data.eval_split == "test" and has_test_split(cfg.data) is False:
                            raise ConfigError(
                                f"dataset '{name}' ({root}) has no test split to report: give a tree with train/ and "
                                "test/, or report a holdout with --set data.n_val=N --set data.eval_split=val")
                    out.append({"config": d, "dataset": name, "labels": n, "method": method, "seed": seed})
    return out


def final_settings(promoted: dict[str, Any], datasets: dict[str, str], labels: list[int] | None, seeds: int,
                   supervised: bool, overrides: list[str]) -> dict[str, Any]:
    """What a final job computes, field by field: recorded with its MLflow parent run, compared when the same
    name runs again (``trainables.search.experiments.check_resumable``)."""
    config = TrainConfig.from_dict(promoted).to_dict()
    return {**{f"config.{k}": v for k, v in flatten(config).items()}, "final.datasets": datasets,
            "final.labels": labels, "final.seeds": seeds, "final.supervised": supervised, "final.set": list(overrides)}


def error_metric(config: dict[str, Any]) -> str:
    """The metric a final run is scored by: the teacher's error on its evaluation split."""
    return f"{config['data']['eval_split']}/error_teacher"


def summarize(records: list[dict[str, Any]], method: str) -> tuple[list[dict[str, Any]], str]:
    """Rows (mean +- std error % per dataset/labels/method) and the markdown table with the paper's numbers."""
    groups: dict[tuple, list[float]] = {}
    for r in records:
        groups.setdefault((r["dataset"], r["labels"], r["method"]), []).append(100 * r["error"])
    rows = [{"dataset": ds, "labels": n, "method": m, "n": len(v), "mean": statistics.fmean(v),
             "std": statistics.stdev(v) if len(v) > 1 else 0.0} for (ds, n, m), v in sorted(groups.items())]

    def cell(x: tuple[float, float | None] | dict | None) -> str:
        if x is None:
            return "-"
        if isinstance(x, dict):
            return f"{x['mean']:.2f} ± {x['std']:.2f} (n={x['n']})"
        return f"{x[0]:.2f}" + (f" ± {x[1]:.2f}" if x[1] is not None else "")

    lines = [f"| dataset | labels | ours: {method} | ours: supervised | paper: {method} | paper: supervised |",
             "|---|---|---|---|---|---|"]
    for ds, n in sorted({(r["dataset"], r["labels"]) for r in rows}):
        ours = {r["method"]: r for r in rows if (r["dataset"], r["labels"]) == (ds, n)}
        paper = PAPER.get(ds, {}).get(n, {})
        label = "all" if n == -1 else "10%" if n == IMAGENET_LABELS else str(n)
        lines.append(f"| {ds} | {label} | {cell(ours.get('promoted'))} | {cell(ours.get('supervised'))} | "
                     f"{cell(paper.get(method))} | {cell(paper.get('supervised'))} |")
    splits = {r.get("split", "test") for r in records}
    what = "Test error" if splits == {"test"} else "Holdout error" if splits == {"val"} else "Error (test or holdout)"
    return rows, "\n".join(lines) + f"\n\n{what} % (teacher), mean ± std over labeled subsets (seeds).\n"


def save_table(out_dir: Path, records: list[dict[str, Any]], method: str) -> tuple[Path, str]:
    rows, table = summarize(records, method)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "final_table.md").write_text(table)
    (out_dir / "final_results.json").write_text(json.dumps({"runs": records, "rows": rows}, indent=2))
    return out_dir / "final_table.md", table
