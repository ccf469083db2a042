"""``cowtune promote``, ``final`` and ``upload``: argparse subcommands (Ray and MLflow load only when run)."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from trainables.validation import ConfigError, writable_folder


def _datasets(text: str) -> dict[str, str]:
    """'cifar10=data/cifar10,svhn=data/svhn' -> {name: root}."""
    out = {}
    for item in text.split(","):
        name, sep, root = item.partition("=")
        if not sep or not name or not root:
            raise argparse.ArgumentTypeError(f"expected NAME=DIR[,NAME=DIR...], got {text!r}")
        out[name.strip()] = root.strip()
    return out


def _labels(text: str) -> list[int]:
    try:
        return [-1 if v.strip() == "all" else int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated label counts (or 'all'), got {text!r}") from None


def _cmd_promote(args: argparse.Namespace) -> int:
    from trainables.search.promote import promote

    info = promote(args.search, args.out, alias=args.alias, model_name=args.model_name, unconfirmed=args.unconfirmed)
    print(json.dumps(info, indent=2))
    print(f"promoted config written to {args.out}; registered as {info['model']} (version {info['version']})")
    return 0


def _cmd_confirm(args: argparse.Namespace) -> int:
    from trainables.search.promote import run

    run(args)
    return 0


def _cmd_final(args: argparse.Namespace) -> int:
    from trainables.search.final import run_final
    from trainables.search.plan import check_job_name

    if not Path(args.config).exists():
        raise ConfigError(f"--config {args.config} does not exist (write it with `cowtune promote`)")
    if args.cpus_per_trial < 1:
        raise ConfigError(f"--cpus-per-trial must be >= 1, got {args.cpus_per_trial}")
    cores = os.cpu_count() or 1   # a local Ray has this machine's cores; a run asking more never starts
    if not os.environ.get("RAY_ADDRESS") and args.cpus_per_trial > cores:
        raise ConfigError(f"--cpus-per-trial must be at most this machine's {cores} cores (Ray would wait for them "
                          f"for ever), got {args.cpus_per_trial}")
    if args.ddp_workers is not None and args.ddp_workers < 1:
        raise ConfigError(f"--ddp-workers must be >= 1 (GPUs per run), got {args.ddp_workers}")
    name = args.name or f"{Path(args.config).stem}-final"
    check_job_name(name)
    # each dataset's folder as an absolute path: the runs train in other folders (Ray's workers)
    args.datasets = {k: str(Path(v).expanduser().resolve()) if "://" not in v and Path(v).expanduser().exists() else v
                     for k, v in args.datasets.items()}
    storage = args.storage or os.environ.get("COWTUNE_STORAGE") or str(Path.cwd() / "ray_results")
    out = args.out or str(Path("final") / name)
    writable_folder(out, "--out", create=False)   # before any run trains: the table is written at the end
    if "://" not in storage:
        writable_folder(storage, "--storage", create=False)
    _, _, failed = run_final(args.config, args.datasets, args.labels, args.seeds, not args.no_supervised, args.set,
                             name, storage, out, args.cpus_per_trial,
                             args.concurrency, args.ddp_workers, check_data=not args.skip_data_check,
                             ray_output=args.ray_output)
    return 1 if failed else 0   # the table holds the runs that finished; the failed ones were listed


def _cmd_upload(args: argparse.Namespace) -> int:
    from trainables.search.mlflow_runs import OUTBOX, outbox_home, upload

    root = Path(args.folder) if args.folder else outbox_home()
    if not root.is_dir() or not any(root.rglob(OUTBOX)):
        raise ConfigError(f"no MLflow records wait in {root} (a trial keeps them there when it ends while the "
                          "tracking server does not answer)")
    done, waiting = upload(root)
    print(f"{done} trial runs delivered" + (f"; {waiting} still wait: MLflow does not answer, run this again "
                                            "when it does" if waiting else ""))
    return 1 if waiting else 0


def confirm_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--search", required=True, help="the search's name (its MLflow experiment)")
    p.add_argument("--seeds", type=int, required=True, metavar="N",
                   help="seeds per config in all (the stage's first seed and those after it), e.g. 8")
    p.add_argument("--only", help="comma-separated finalists to extend (default: the one with the lowest mean)")
    p.add_argument("--storage", help="where the new runs' Ray results go (default: $COWTUNE_STORAGE or ./ray_results)")
    p.add_argument("--cpus-per-trial", type=int, default=1)
    p.add_argument("--gpu-share", type=float, metavar="F", help="each run's share of a GPU (e.g. 0.125: 8 per GPU)")
    p.add_argument("--concurrency", type=int, default=None, help="max runs at once (default: as resources allow)")
    p.add_argument("--ray-output", action="store_true", help="Ray Tune's own progress output")


def add_search_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("promote", help="register the confirmed best config of a search and write it")
    p.add_argument("--search", required=True, help="search name (the MLflow experiment), e.g. cifar10_cowmix")
    p.add_argument("--out", default="promoted.yaml", help="promoted config file (default promoted.yaml)")
    p.add_argument("--alias", default="champion", help="model registry alias (default champion)")
    p.add_argument("--model-name", help="registered model name (default: the search name)")
    p.add_argument("--unconfirmed", action="store_true",
                   help="a search without a confirm stage: promote its single best trial (one seed: partly luck)")
    p.set_defaults(func=_cmd_promote)

    c = sub.add_parser("confirm", help="add fresh seeds to a search's confirm stage and judge it again over all of them")
    confirm_arguments(c)
    c.set_defaults(func=_cmd_confirm)

    f = sub.add_parser("final", help="train the promoted config on datasets x label counts x seeds; test-split table")
    f.add_argument("--config", default="promoted.yaml", help="promoted config (default promoted.yaml)")
    f.add_argument("--datasets", type=_datasets, required=True, metavar="NAME=DIR,...",
                   help="cifar10, cifar100, svhn, imagenet (an ImageFolder tree) or any registered dataset")
    f.add_argument("--labels", type=_labels, help="label counts, e.g. 250,1000,4000,all (default: the paper's)")
    f.add_argument("--seeds", type=int, default=5, help="labeled subsets per label count (default 5)")
    f.add_argument("--no-supervised", action="store_true", help="skip the supervised-only runs of the same seeds")
    f.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field of every run")
    f.add_argument("--name", help="experiment name (default <config>-final)")
    f.add_argument("--storage", help="Ray results folder or URI (default $COWTUNE_STORAGE or ./ray_results)")
    f.add_argument("--out", help="folder for final_table.md and final_results.json (default final/<name>)")
    f.add_argument("--cpus-per-trial", type=int, default=1)
    f.add_argument("--concurrency", type=int, default=None)
    f.add_argument("--ddp-workers", type=int, help="data-parallel workers (GPUs) per run, splitting each batch of train.batch_size "
                   "(default: 1; ImageNet: every GPU, CPU: 2)")
    f.add_argument("--skip-data-check", action="store_true",
                   help="do not look for the data files on the driver (they exist only on the workers)")
    f.add_argument("--ray-output", action="store_true", help="Ray Tune's own progress output (default: a line a run)")
    f.set_defaults(func=_cmd_final)

    u = sub.add_parser("upload", help="deliver the MLflow records trials kept while the tracking server was away")
    u.add_argument("folder", nargs="?", help="where they wait (default $COWTUNE_OUTBOX or ~/.cowtune/mlflow-outbox)")
    u.set_defaults(func=_cmd_upload)
