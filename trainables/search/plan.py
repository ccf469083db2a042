"""Search settings, the search scripts' command line, and every check that runs before Ray starts.

Plain Python (no Ray, no MLflow): ``prepare_search`` resolves the base config (preset, --data,
--epochs, --set, --smoke-test), refuses any search that could read the test split, encodes the
paper's settings as the first point, and builds a config from a spread of space samples so a bad
space fails on the driver in a second instead of as a failed trial on a worker.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import math
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainables import metrics as M
from trainables.config import TrainConfig
from trainables.data import TRAIN_SIZES, check_source, make_splits, train_size
from trainables.data.image_files import listed_labels
from trainables.presets import apply_overrides, read_config_file
from trainables.search import intervals
from trainables.search.gate import Confirm
from trainables.trainer import check_names
from trainables.validation import ConfigError, check, flatten, writable_folder

METHOD_KEYS = ("perturb", "mix", "teacher")   # what a search file owns; --preset supplies the rest
# The objective's data: a stratified 5,000-image holdout of the training split, never the test split.
HOLDOUT = ("data.n_val=5000", "data.eval_split=val")
SMOKE = {"model": "cnn_tiny", "data": {"dataset": "digits", "n_val": 200, "n_labeled": 50, "eval_split": "val"},
         "train": {"epochs": 2, "steps_per_epoch": 3, "batch_size": 16, "eval_batch_size": 256, "bn_batch": None}}


@dataclass(frozen=True, kw_only=True)
class SearchSettings:
    name: str
    metric: str = M.VAL_ERROR_TEACHER
    mode: str = "min"
    num_samples: int = 32
    seed: int = 0                      # TPE sampler seed
    reduction_factor: int = 3
    grace_period: int | None = None    # epochs; None: the rule in trainables/search/driver.py
    min_rung: float = 0.25             # ASHA's first rung at least this share of the budget (the rule's epochs / 4)
    points: tuple[dict[str, Any], ...] = ()   # known settings of space fields, tried after the paper's, in order
    max_failures: int = 2
    validation_samples: int = 16       # space samples turned into configs on the driver before Ray
    mean_of_last: int = 1              # the objective: ``metric`` averaged over the last N epochs reported
    confirm: Confirm | None = None     # re-run the leading trials and the paper's on fresh seeds (trainables.search.gate)

    def __post_init__(self) -> None:
        check(self.mode in ("min", "max"), "SearchSettings.mode", "be 'min' or 'max'", self.mode)
        check(self.num_samples >= 1, "SearchSettings.num_samples", "be >= 1", self.num_samples)
        check(self.mean_of_last >= 1, "SearchSettings.mean_of_last", "be >= 1", self.mean_of_last)
        check(0 < self.min_rung <= 1, "SearchSettings.min_rung", "be in (0, 1]", self.min_rung)
        check(self.confirm is None or self.mode == "min", "SearchSettings.confirm", "go with mode 'min'", self.mode)

    @property
    def objective(self) -> str:
        """What the search ranks by: ``metric`` averaged over the last ``mean_of_last`` epochs."""
        return M.mean_of_last(self.metric, self.mean_of_last)


@dataclass(frozen=True)
class Plan:
    name: str
    base: dict[str, Any]
    points: list[dict[str, Any]]
    num_samples: int
    epochs: int
    grace: int
    seed: int
    storage: str
    fingerprint: str
    tags: dict[str, str]
    settings: dict[str, Any]   # flat: what the search computes, field by field (its MLflow parent's parameters)
    confirm: Confirm | None = None   # the confirm stage as this command runs it (None: off)


# GPU share per trial by model, so that packed trials fit one 80 GB card. wrn28_2: four (H100, trials taking turns: 2, 4, 8
# packed deliver 135 steps/s, one alone 127), so that start-ups and evaluations overlap the others' training.
GPU_FRACTION = {"cnn_tiny": 0.125, "wrn28_2": 0.25, "wrn26_2_shakeshake": 0.5, "wrn20_6_shakeshake": 0.5,
                "resnet18": 0.5, "wrn28_8": 1.0, "wrn26_6_shakeshake": 1.0, "resnet50": 1.0, "resnet152": 1.0}


def trial_resources(model: str, cpus: int, gpus_in_cluster: float, share: float | None = None) -> dict[str, float]:
    """{"cpu": cpus, "gpu": share of the model (or ``share``)} when the cluster has GPUs, else CPU only."""
    if gpus_in_cluster <= 0:
        return {"cpu": cpus}
    if share is not None:
        return {"cpu": cpus, "gpu": share}
    if model not in GPU_FRACTION:
        raise ConfigError(f"model '{model}' has no entry in GPU_FRACTION; known: {', '.join(sorted(GPU_FRACTION))}")
    return {"cpu": cpus, "gpu": GPU_FRACTION[model]}


def parse_args(settings: SearchSettings, argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=f"search {settings.name}")
    p.add_argument("--trials", type=int, help=f"number of trials (default {settings.num_samples})")
    p.add_argument("--epochs", type=int, help="epochs per trial (the full budget; ASHA's max_t)")
    p.add_argument("--data", help="dataset folder (sets data.root)")
    p.add_argument("--preset", help="take everything but the method from a trainer preset, e.g. 'fast'")
    p.add_argument("--smoke-test", action="store_true", help="tiny data, model, epochs and trials (CI)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a base config field")
    p.add_argument("--name", help=f"search name (default {settings.name}[-preset])")
    p.add_argument("--storage", help="Ray results folder or URI (default $COWTUNE_STORAGE or ./ray_results)")
    p.add_argument("--optuna-storage", metavar="URL",
                   help="database of the Optuna study, an SQLAlchemy URL (default $COWTUNE_OPTUNA_STORAGE, else the "
                        "SQLite file STORAGE/NAME.optuna.db); the same command with a larger --trials grows a finished "
                        "search")
    p.add_argument("--concurrency", type=int, default=None, help="max trials at once (default: as resources allow)")
    p.add_argument("--cpus-per-trial", type=int, default=1)
    p.add_argument("--gpu-share", type=float, metavar="F",
                   help="GPU share per trial, e.g. 0.125 to pack 8 trials on a GPU (default: the model's, "
                        "GPU_FRACTION in trainables/search/plan.py; each trial caps its memory at it)")
    p.add_argument("--seed", type=int, help=f"TPE seed (default {settings.seed})")
    p.add_argument("--no-compile-ahead", action="store_true",
                   help="do not compile the training step on this machine's GPU while the trials start "
                        "(trainables/search/compile_ahead.py); each trial then compiles its own")
    p.add_argument("--skip-data-check", action="store_true",
                   help="do not look for the data files on this machine (they exist only on the workers)")
    p.add_argument("--no-confirm", action="store_true",
                   help="skip the confirm stage (the leading trials and the paper's config re-run on fresh seeds); "
                        "`cowtune promote` then needs --unconfirmed")
    p.add_argument("--confirm-seeds", type=int, metavar="N",
                   help="fresh seeds of the confirm stage (default: the search file's Confirm.seeds; at least 3)")
    p.add_argument("--finalists", type=int, metavar="N",
                   help="leading trials the confirm stage re-runs beside the paper's (default: the search file's)")
    p.add_argument("--ray-output", nargs="?", type=int, const=1, choices=(1, 2), metavar="LEVEL",
                   help="Ray Tune's own console output (its trial status tables, each trial's config and result, the "
                        "trials' per-epoch lines) instead of the compact progress table; LEVEL 2: every result")
    return p.parse_args(argv)


def check_job_name(name: str, flag: str = "--name") -> None:
    """A search or final job's name names a folder, a lock file and an MLflow experiment: one plain word."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", name):
        raise ConfigError(f"{flag} must be one word of letters, digits, '.', '_' or '-' (it names a folder and an "
                          f"MLflow experiment), got {name!r}")


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def _sample(spec: tuple, rng: random.Random) -> Any:
    if spec[0] == "choice":
        return rng.choice(spec[1])
    lo, hi, log = spec[1], spec[2], spec[3]
    return math.exp(rng.uniform(math.log(lo), math.log(hi))) if log else rng.uniform(lo, hi)


def grace_rule(base: TrainConfig, space: dict[str, Any], epochs: int, min_rung: float = 0.25) -> int:
    alpha = dict(intervals.leaves(space)).get("teacher.alpha")
    alpha_max = alpha.high if isinstance(alpha, intervals.Float) else base.teacher.alpha
    n_train = train_size(base.data) or 50000                 # an unreadable root fails later, in check_files
    steps = base.train.steps_per_epoch or max(1, (n_train - base.data.n_val) // base.train.batch_size)
    horizon = 1.0 / max(1e-9, (1.0 - alpha_max) * steps)
    return min(epochs, max(1, math.ceil(epochs * min_rung), math.ceil(3 * horizon)))


def prepare_search(base: Any, space: dict[str, Any], settings: SearchSettings, args: argparse.Namespace) -> Plan:
    """Resolve and check everything; raises ConfigError naming the problem."""
    d = base.to_dict() if isinstance(base, TrainConfig) else copy.deepcopy(base)
    name = settings.name
    if args.preset:
        d = {**read_config_file(args.preset), **{k: d.get(k) for k in METHOD_KEYS}}
        name += f"-{args.preset}"
    if args.smoke_test:
        d, name = merge(d, SMOKE), name + "-smoke"
    if args.data:
        check(Path(args.data).exists(), "--data", "name an existing dataset folder or zip", args.data)
        d = merge(d, {"data": {"root": args.data}})
    if args.epochs is not None:   # 0 is refused by the config's own check, not taken for "unset"
        d = merge(d, {"train": {"epochs": args.epochs}})
    d = apply_overrides(d, args.set)
    data = d.setdefault("data", {})
    data["root"] = str(Path(data.get("root") or "data").resolve())   # trials run in other folders
    cfg = TrainConfig.from_dict(d)
    check_names(cfg)
    check(cfg.data.eval_split == "val" and cfg.data.n_val > 0, "data.eval_split",
          "be 'val' with data.n_val > 0 in a search (a search never reads the test split)", cfg.data.eval_split)
    d = cfg.to_dict()
    points = [intervals.encode(space, d)]            # the paper's settings are evaluated first
    for p in settings.points:
        extra = set(flatten(p)) - {path for path, _ in intervals.leaves(space)}
        check(not extra, "SearchSettings.points", "set only fields of the search space", sorted(extra))
        try:
            points.append(intervals.encode(space, TrainConfig.from_dict(merge(d, p)).to_dict()))
        except ConfigError as exc:
            raise ConfigError(f"SearchSettings.points {p} makes an invalid config: {exc}") from None
    rng = random.Random(settings.seed)
    specs = intervals.space_params(space)
    for i in range(settings.validation_samples):
        values = {k: _sample(s, rng) for k, s in specs.items()}
        try:
            sample = TrainConfig.from_dict(merge(d, intervals.decode(space, values)))
        except ConfigError as exc:
            raise ConfigError(f"search space sample {i} {values} makes an invalid config: {exc}") from None
        check(sample.data.eval_split == "val", "search space", "never set data.eval_split to 'test'", values)
    check(args.gpu_share is None or 0 < args.gpu_share <= 1, "--gpu-share", "be in (0, 1]", args.gpu_share)
    trials = args.trials if args.trials is not None else (2 if args.smoke_test else settings.num_samples)
    check(trials >= 1, "--trials", "be >= 1", trials)
    epochs = cfg.train.epochs
    grace = settings.grace_period or grace_rule(cfg, space, epochs, settings.min_rung)
    check(args.storage is None or args.storage.strip(), "--storage", "name a folder or a URI (leave it out for "
          "./ray_results)", args.storage)
    storage = args.storage or os.environ.get("COWTUNE_STORAGE") or str(Path.cwd() / "ray_results")
    storage = storage if "://" in storage else str(writable_folder(storage, "--storage", create=False).resolve())
    seed = settings.seed if args.seed is None else args.seed
    name = name if args.name is None else args.name   # --name '' is refused, not read as the default
    check_job_name(name)
    check(args.cpus_per_trial >= 1, "--cpus-per-trial", "be >= 1", args.cpus_per_trial)
    check(args.concurrency is None or args.concurrency >= 1, "--concurrency", "be >= 1 (leave it out for as many "
          "as the resources allow)", args.concurrency)
    if not os.environ.get("RAY_ADDRESS"):   # a local Ray has this machine's cores; a trial asking more never starts
        cores = os.cpu_count() or 1
        check(args.cpus_per_trial <= cores, "--cpus-per-trial", f"be at most this machine's {cores} cores (Ray "
              "would wait for them for ever)", args.cpus_per_trial)
    key = json.dumps([d, repr(sorted(intervals.leaves(space), key=lambda t: t[0])), trials, seed, grace]
                     + ([points[1:]] if settings.points else [])    # unchanged for searches without points
                     + ([settings.objective] if settings.mean_of_last > 1 else []), sort_keys=True)
    fingerprint = hashlib.sha256(key.encode()).hexdigest()[:16]
    tags = {"cowtune.search": name, "cowtune.fingerprint": fingerprint, "dataset": cfg.data.dataset,
            "n_labeled": str(cfg.data.n_labeled), "method": cfg.method, "model": cfg.model,
            "cowtune.trials": str(trials), "cowtune.epochs": str(epochs)}
    recorded = {**{f"config.{k}": v for k, v in flatten(d).items()},
                **{f"space.{path}": repr(domain) for path, domain in intervals.leaves(space)},
                "search.trials": trials, "search.seed": seed, "search.grace": grace, "search.objective": settings.objective,
                **({"search.points": points[1:]} if settings.points else {})}
    confirm = confirm_stage(settings, args, cfg.seed)
    tags["cowtune.objective"] = settings.objective
    return Plan(name, d, points, trials, epochs, grace, seed, storage, fingerprint, tags, recorded, confirm)


def confirm_stage(settings: SearchSettings, args: argparse.Namespace, search_seed: int) -> Confirm | None:
    """The search file's confirm stage with the command's changes; its seeds must be fresh: the finalists were
    chosen on the search trials' seed."""
    if args.no_confirm or settings.confirm is None:
        return None
    confirm = settings.confirm
    if args.finalists is not None:
        check(args.finalists >= 1, "--finalists", "be >= 1", args.finalists)
        confirm = dataclasses.replace(confirm, finalists=args.finalists)
    if args.confirm_seeds is not None:
        check(args.confirm_seeds >= 3, "--confirm-seeds", "be >= 3 (a mean of fewer seeds is an anecdote)",
              args.confirm_seeds)
        confirm = dataclasses.replace(confirm, seeds=tuple(search_seed + 1 + k for k in range(args.confirm_seeds)))
    rounds = [s for k in range(confirm.halvings + 1) for s in confirm.seeds_of_round(k)]
    check(search_seed not in rounds, "Confirm.seeds", f"not include the search trials' seed {search_seed} (the "
          "finalists were chosen on it)", rounds)
    return confirm


# Classes of the datasets whose size is known without their files (TRAIN_SIZES): CIFAR's are balanced, SVHN's hold
# thousands each, so the holdout and labeled subset are checked against balanced labels of that size
CLASSES = {"cifar10": 10, "cifar100": 100, "svhn": 10}


def check_files(plan: Plan, args: argparse.Namespace) -> None:
    """The data files a trial will read are there (listed, not decoded); raises ConfigError.
    ``--skip-data-check`` skips this where only the workers hold the data."""
    if not args.skip_data_check:
        check_source(TrainConfig.from_dict(plan.base).data)


def check_data_fits(plan: Plan, args: argparse.Namespace) -> None:
    """The trials' holdout and labeled subset fit their data, as `cowtune train` finds before it trains (after
    ``check_files``); raises ConfigError. With ``--skip-data-check`` only a dataset of known size is checked."""
    check_splits(TrainConfig.from_dict(plan.base), listed=not args.skip_data_check)


def check_splits(cfg: TrainConfig, listed: bool = True) -> None:
    """``make_splits``' checks of data.n_val and data.n_labeled (a holdout larger than the data, fewer labels than
    classes, a class too small to split) against the labels the data will have: an ImageFolder's from its listing
    (``listed``), digits' and torchvision datasets' from their known sizes. Nothing is decoded."""
    d = cfg.data
    if d.dataset == "imagefolder" and listed:
        labels = listed_labels(os.path.abspath(os.path.expanduser(d.root)), d.root, d.unreadable)
    elif d.dataset == "digits":
        from sklearn.datasets import load_digits
        labels = load_digits().target
    elif d.dataset in CLASSES:
        labels = np.arange(TRAIN_SIZES[d.dataset]) % CLASSES[d.dataset]
    else:
        return
    make_splits(labels, d.n_val, d.val_seed, d.n_labeled, cfg.labeled_seed)
