"""``cowtune final``: the promoted config x datasets x label counts x 5 labeled subsets, on the test split.

One Ray Tune experiment (a grid of full configs, no search) under one MLflow parent run; each run
trains on all training images (``n_val=0``) with labeled subset ``seed`` and reports the teacher's
test error. The paper-style table (mean +- std over seeds per dataset and label count, next to a
supervised-only run of the same seeds and the paper's numbers) is printed and saved.
ImageNet (``--datasets imagenet=DIR``, any ImageFolder tree of its layout): the ``imagenet_cowmix`` preset (the
paper's ImageNet setup: ResNet-152, batch 1024, its LR, L2, schedule, epochs, teacher, omega and threshold) with
only what transfers carried over from the promoted small-image config (``transfer``): its regularizers, their
p ranges and the mix path's confidence rule; sigma scaled with the image side as in the paper ((4, 16) at 32 px
<-> (32, 128) at 224 px); 10% of the tree's training images labeled (floor, stratified per class as the
reference's subsets). ``provenance`` says where each field came from; the table carries it.

Runs ``cowtune final`` on Ray: a grid of full configs (no search) logged under one MLflow parent run.
"""
from __future__ import annotations

import copy
import hashlib
import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import ray
import yaml
from ray import tune

from trainables.config import DataConfig, TrainConfig, check_batch_split
from trainables.data import check_source
from trainables.data.sources import check_dataset, has_test_split
from trainables.presets import IMAGENET_PRESET, apply_overrides, read_config_file, yaml_problem
from trainables.search import experiments, mlflow_runs, progress
from trainables.search.confirm import ConfirmProgress
from trainables.search.experiments import (FinishChildRuns, check_resumable, check_tracking_server, lock_job,
                                           open_experiment)
from trainables.search.trial import META, TRAIN_CONFIG, train_trial, trial_resources
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
PAPER_TOP5 = {"imagenet": {-10: {"supervised": (22.12, None), "cowmix": (8.76, 0.07)}}}   # its ImageNet table
IMAGENET_LABELS = -10          # marker: 10% of the training images
SOURCE_SIZE = 32               # the side of the images a promoted config was searched on, unless its data.image_size
# The mix path's fields the paper re-set for ImageNet (omega 30 -> 100, threshold 0.6 -> 0.5): the preset's
PRESET_MIX_FIELDS = ("weight", "conf_thresh")
FINAL_FIELDS = ("seed", "data.root", "data.n_val", "data.eval_split", "data.labeled_seed", "data.n_labeled")


def sigma_scale(source_size: int, target_size: int) -> float:
    """The paper's (4, 16) at 32 px is its (32, 128) at 224 px: 8x from 32 to 224 px, linear in each side."""
    return 8.0 * (target_size / 224.0) * (SOURCE_SIZE / source_size)


def imagenet_sigma_scale(image_size: int) -> float:
    """From the 32 px images of a small-image search to ``image_size``: 8x at 224 px."""
    return sigma_scale(SOURCE_SIZE, image_size)


def ten_percent(n_train: int) -> int:
    """The reference's 10% subset size: floor (1,281,167 ImageNet images -> its 128,116)."""
    return max(1, n_train // 10)


def transfer(preset: dict[str, Any], promoted: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The large-image config of a promoted small-image one (both full ``TrainConfig.to_dict()`` dicts).

    What the paper kept at both scales comes from ``promoted``: which regularizers (the method), and each path's
    fields (the p ranges, the blended confidence, the fraction-passing weight, mix_logits; the erasure path whole,
    having no ImageNet values in the paper). sigma (in pixels) is scaled with the image side (``sigma_scale``).
    What the paper re-set for ImageNet comes from ``preset``: the mix path's omega and threshold, and every other
    section (model, data, optim, teacher, train). Returns (config, {dotted field: 'promoted' | 'scaled xF'});
    a field not named there is the preset's.
    """
    out, sources = copy.deepcopy(preset), {}
    source = promoted["data"].get("image_size") or SOURCE_SIZE
    factor = sigma_scale(source, out["data"].get("image_size") or 224)
    for key in ("perturb", "mix"):
        path = copy.deepcopy(promoted.get(key))
        sources.update({f"{key}.{k}": "promoted" for k in path} if path else {key: "promoted"})   # None: off
        if path and key == "mix" and preset.get("mix"):
            path.update({k: preset["mix"][k] for k in PRESET_MIX_FIELDS})
            sources.update({f"mix.{k}": "preset" for k in PRESET_MIX_FIELDS})
        if path and "sigma_range" in path:
            path["sigma_range"] = [s * factor for s in path["sigma_range"]]
            sources[f"{key}.sigma_range"] = (f"scaled x{factor:g} from the promoted {promoted[key]['sigma_range']} "
                                             f"({source} -> {out['data'].get('image_size')} px)")
        out[key] = path
    return out, sources


def imagenet_base(promoted: dict[str, Any], overrides: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """``transfer`` onto the preset at the image size ``--set`` gives (sigma scales to it), then the overrides over
    what was carried (they may name a path only the promoted config has, e.g. perturb.weight)."""
    sized = [item for item in overrides if item.partition("=")[0].strip() == "data.image_size"]
    preset = TrainConfig.from_dict(apply_overrides(read_config_file(IMAGENET_PRESET), sized)).to_dict()
    config, sources = transfer(preset, promoted)
    sources.update({item.split("=", 1)[0].strip(): "--set" for item in overrides})
    return apply_overrides(config, overrides), sources


def provenance(promoted: dict[str, Any], overrides: list[str]) -> str:
    """A markdown table: each ImageNet field the preset states, the promoted config carries or --set gives, its
    value and where it came from; every other field is its default."""
    promoted = TrainConfig.from_dict(promoted).to_dict()
    config, sources = imagenet_base(promoted, overrides)
    stated = set(flatten(read_config_file(IMAGENET_PRESET))) | set(sources)
    values, before = flatten(config), flatten(promoted)
    lines = [f"ImageNet runs: the {IMAGENET_PRESET} preset, with what transfers from the promoted config:", "",
             "| field | value | from |", "|---|---|---|"]
    for key in sorted(k for k in stated if k not in FINAL_FIELDS and (k in values or k.split(".")[0] in values)):
        value = values.get(key, values.get(key.split(".")[0]))   # a path that is off: null
        source = sources.get(key, "preset")
        if source == "preset" and key in before and before[key] != value:   # what the promoted config had instead
            source += f" (promoted: {json.dumps(before[key])}, not carried)"
        lines.append(f"| {key} | {json.dumps(value)} | {source} |")
    lines.append("| data.n_labeled | 10% of the tree's training images (floor), stratified per class | final |")
    return "\n".join(lines) + "\n\nEvery other field: its default (the promoted config's are not carried).\n"


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
        if name != "imagenet":   # an ImageFolder tree read with the ImageNet preset; the rest by their loaders
            check_dataset(name)
        known = PAPER.get(name)
        counts = labels or (sorted(known) if known else None)
        if counts is None:
            raise ConfigError(f"--labels is required for dataset '{name}' (no paper label counts). Known: {', '.join(PAPER)}")
        n_train = None   # ImageNet's 10% labels: its training images, counted once
        base = imagenet_base(promoted, overrides)[0] if name == "imagenet" else promoted
        first = len(out)
        for n in counts:
            for method in ("promoted", "supervised") if supervised else ("promoted",):
                for seed in range(seeds):
                    d = copy.deepcopy(base)
                    d["seed"] = seed
                    d["data"].update(root=root, n_val=0, eval_split="test", labeled_seed=seed, n_labeled=n)
                    if name != "imagenet":
                        d["data"]["dataset"] = name
                    elif n == IMAGENET_LABELS:
                        n_train = n_train or _count_train_images(d["data"], check_data)
                        d["data"]["n_labeled"] = ten_percent(n_train)
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
    preset = {"final.imagenet_preset": read_config_file(IMAGENET_PRESET)} if "imagenet" in datasets else {}
    return {**{f"config.{k}": v for k, v in flatten(config).items()}, "final.datasets": datasets,
            "final.labels": labels, "final.seeds": seeds, "final.supervised": supervised, "final.set": list(overrides),
            **preset}


def error_metric(config: dict[str, Any]) -> str:
    """The metric a final run is scored by: the teacher's error on its evaluation split."""
    return f"{config['data']['eval_split']}/error_teacher"


def summarize(records: list[dict[str, Any]], method: str) -> tuple[list[dict[str, Any]], str]:
    """Rows (mean +- std error % per dataset/labels/method) and the markdown table with the paper's numbers."""
    rows = _rows(records, "error", "top-1")
    rows5 = _rows([r for r in records if r.get("error5") is not None], "error5", "top-5")

    def cell(x: tuple[float, float | None] | dict | None) -> str:
        if x is None:
            return "-"
        if isinstance(x, dict):
            return f"{x['mean']:.2f} ± {x['std']:.2f} (n={x['n']})"
        return f"{x[0]:.2f}" + (f" ± {x[1]:.2f}" if x[1] is not None else "")

    def table(rows: list[dict[str, Any]], paper_numbers: dict, name: str) -> list[str]:
        lines = [f"| dataset | labels | ours: {method}{name} | ours: supervised{name} | paper: {method}{name} | "
                 f"paper: supervised{name} |", "|---|---|---|---|---|---|"]
        for ds, n in sorted({(r["dataset"], r["labels"]) for r in rows}):
            ours = {r["method"]: r for r in rows if (r["dataset"], r["labels"]) == (ds, n)}
            paper = paper_numbers.get(ds, {}).get(n, {})
            label = "all" if n == -1 else "10%" if n == IMAGENET_LABELS else str(n)
            lines.append(f"| {ds} | {label} | {cell(ours.get('promoted'))} | {cell(ours.get('supervised'))} | "
                         f"{cell(paper.get(method))} | {cell(paper.get('supervised'))} |")
        return lines

    lines = table(rows, PAPER, "")
    if rows5:   # more than 10 classes (ImageNet): top-5 error too
        lines += ["", *table(rows5, PAPER_TOP5, " (top-5)")]
    splits = {r.get("split", "test") for r in records}
    what = "Test error" if splits == {"test"} else "Holdout error" if splits == {"val"} else "Error (test or holdout)"
    return rows + rows5, \
        "\n".join(lines) + f"\n\n{what} % (teacher), mean ± std over labeled subsets (seeds).\n"


def _rows(records: list[dict[str, Any]], key: str, metric: str) -> list[dict[str, Any]]:
    """Mean +- std of ``key`` (error %) per dataset, labels and method."""
    groups: dict[tuple, list[float]] = {}
    for r in records:
        groups.setdefault((r["dataset"], r["labels"], r["method"]), []).append(100 * r[key])
    return [{"dataset": ds, "labels": n, "method": m, "metric": metric, "n": len(v), "mean": statistics.fmean(v),
             "std": statistics.stdev(v) if len(v) > 1 else 0.0} for (ds, n, m), v in sorted(groups.items())]


def save_table(out_dir: Path, records: list[dict[str, Any]], method: str, notes: str = "") -> tuple[Path, str]:
    """final_table.md (the table, then ``notes``: e.g. ``provenance``) and final_results.json."""
    rows, table = summarize(records, method)
    table += f"\n{notes}" if notes else ""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "final_table.md").write_text(table)
    (out_dir / "final_results.json").write_text(json.dumps({"runs": records, "rows": rows}, indent=2))
    return out_dir / "final_table.md", table


def run_final(config_path: str, datasets: dict[str, str], labels: list[int] | None, seeds: int, supervised: bool,
              overrides: list[str], name: str, storage: str, out_dir: str, cpus_per_trial: int = 1,
              concurrency: int | None = None, ddp_workers: int | None = None,
              check_data: bool = True, ray_output: bool = False) -> tuple[list[dict[str, Any]], str, int]:
    try:
        promoted = yaml.safe_load(Path(config_path).read_text())
    except yaml.YAMLError as exc:   # one line naming the file, before anything starts
        raise ConfigError(f"--config {config_path} is not valid YAML: {yaml_problem(exc)}") from None
    method = TrainConfig.from_dict(promoted).method
    runs = final_configs(promoted, datasets, labels, seeds, supervised, overrides, check_data)   # fails before Ray
    notes = provenance(promoted, overrides) if "imagenet" in datasets else ""   # where each ImageNet field came from
    if ddp_workers:   # the batch split too (ImageNet's default, every GPU, once Ray has counted them)
        check(ddp_workers >= 1, "--ddp-workers", "be >= 1", ddp_workers)
        for r in runs:
            check_batch_split(TrainConfig.from_dict(r["config"]), ddp_workers)
    storage = storage if "://" in storage else str(Path(storage).resolve())
    settings = final_settings(promoted, datasets, labels, seeds, supervised, overrides)
    fingerprint = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    tags = {"cowtune.search": name, "cowtune.final": config_path, "method": method, "cowtune.fingerprint": fingerprint}
    check_tracking_server()
    lock_job(name, storage, "final job")
    check_resumable(name, storage, tags, settings)   # the same name again: the same job, or refused before Ray
    uri, experiment_id, exp_path, parent_id, restoring = open_experiment(name, storage, tags, settings)
    gpus = ray.cluster_resources().get("GPU", 0)
    for r in runs:   # ImageNet: data-parallel over every GPU (CPU: 2 workers) unless told; small images: 1 unless told
        r["ddp_workers"] = ddp_workers or (max(2, int(gpus)) if r["dataset"] == "imagenet" else 1)
        if not ddp_workers:   # told: checked above, before Ray
            check_batch_split(TrainConfig.from_dict(r["config"]), r["ddp_workers"])
    meta = {"uri": uri, "experiment_id": experiment_id, "parent_run_id": parent_id, "mode": "final",
            "git_sha": mlflow_runs.git_sha(), "cpus": cpus_per_trial, "gpu": 0, "use_gpu": gpus > 0, "storage": storage}

    def resources(spec: dict[str, Any]) -> dict[str, float]:
        if spec[TRAIN_CONFIG]["ddp_workers"] > 1:
            return {"cpu": 0, "memory": 2**20}   # a token bundle: the Ray Train workers it launches hold CPUs/GPUs
        return trial_resources(spec[TRAIN_CONFIG]["config"]["model"], cpus_per_trial, gpus)

    trainable = tune.with_resources(train_trial, resources)
    verbose = progress.verbose(SimpleNamespace(ray_output=ray_output))   # Ray Tune's output, or one line a run
    shown = [] if ray_output else [ConfirmProgress(name, error_metric(runs[0]["config"]), "min", 0, [], stage="final")]
    print(f"final {name}: {len(runs)} runs ({method}{' + supervised' if supervised else ''} x {seeds} seeds); "
          f"MLflow {uri} (parent run {parent_id})" + (" [resuming]" if restoring else "") + (f"\n{notes}" if notes else ""),
          flush=True)
    if restoring:
        tuner = tune.Tuner.restore(exp_path, trainable=trainable, resume_unfinished=True, resume_errored=True)
    else:
        tuner = tune.Tuner(trainable, param_space={TRAIN_CONFIG: tune.grid_search(runs), META: meta},
                           tune_config=tune.TuneConfig(reuse_actors=True, max_concurrent_trials=concurrency),
                           run_config=tune.RunConfig(name=name, storage_path=storage, verbose=verbose,
                                                     failure_config=tune.FailureConfig(max_failures=2),
                                                     checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
                                                     callbacks=[FinishChildRuns(uri, experiment_id, parent_id, 0),
                                                                *shown]))
    experiments.stop_cleanly()   # after ray.init: SIGTERM as Ctrl-C, not Ray's stack dump
    try:
        results = tuner.fit()
    except BaseException:   # a second Ctrl-C, a Ray error: the parent run says so (the same command resumes it)
        mlflow_runs.finish_run(uri, parent_id, "FAILED")
        raise
    if (by := experiments.stopped_by()) is not None:   # Tune stopped the runs cleanly and saved its state
        mlflow_runs.finish_run(uri, parent_id, "KILLED")
        ray.shutdown()
        print(f"{name}: stopped by {by}; Ray saved its state: run the same command to resume", file=sys.stderr)
        raise SystemExit(143 if by == "SIGTERM" else 130)
    records, failed = [], []
    for r in results:
        spec = r.config[TRAIN_CONFIG]
        key = error_metric(spec["config"])
        err = (r.metrics or {}).get(key)
        run = {k: spec[k] for k in ("dataset", "labels", "method", "seed")}
        if r.error or err is None:
            why = str(r.error).strip().splitlines()[-1] if r.error else f"no {key} reported"
            failed.append(f"  {run['dataset']} labels {run['labels']} {run['method']} seed {run['seed']}: {why[:300]}")
            continue
        err5 = (r.metrics or {}).get(key.replace("/error_", "/error5_"))   # top-5: more than 10 classes
        records.append(run | {"error": err, "split": spec["config"]["data"]["eval_split"]}
                       | ({"error5": err5} if err5 is not None else {}))
    table = ""
    if records:
        path, table = save_table(Path(out_dir), records, method, notes)
        for artifact in (path, path.with_name("final_results.json")):
            mlflow_runs.log_run_artifact(uri, parent_id, artifact)
        print(table + f"\nsaved {path}", flush=True)
    mlflow_runs.finish_run(uri, parent_id, "FAILED" if failed else "FINISHED")
    print(f"{len(records)}/{len(results)} runs finished" + (f"; {len(failed)} failed:\n" + "\n".join(failed)
                                                             if failed else ""), flush=True)
    return records, table, len(failed)
