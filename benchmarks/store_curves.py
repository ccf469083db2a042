"""Every run of a search, out of its MLflow store, as one JSON of curves and one PNG: the search's trials and its
confirm stage's runs, each with its stage, candidate, seed, sampled parameters and per-epoch holdout error.

    python benchmarks/store_curves.py STORE --search NAME --out docs/results/X.json --png docs/results/X.png \
        --what "..." --gpu "..." --date "..." --commit SHA

STORE is a folder holding ``mlflow.db`` (and ``mlartifacts/``) or the ``store.tar.gz`` that
``benchmarks/device_search.sh`` brings back. The PNG shows the confirm stage: one panel per config, one line per
seed, the objective's window average against the epoch.
"""
from __future__ import annotations

import argparse
import json
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script from anywhere: the repo's packages

CANDIDATE_TAG, SEED_TAG = "cowtune.candidate", "cowtune.confirm_seed"   # trainables.search.confirm's (it imports Ray)
CURVES = ("val/error_teacher", "val/error_teacher_mean3")


def open_store(store: Path) -> Path:
    """The folder holding ``mlflow.db``: ``store`` itself, or a tarball unpacked into a temporary folder."""
    if store.is_dir():
        if not (store / "mlflow.db").is_file():
            raise SystemExit(f"{store}: no mlflow.db there")
        return store
    if not tarfile.is_tarfile(store):
        raise SystemExit(f"{store}: neither a folder holding mlflow.db nor a tarball")
    folder = Path(tempfile.mkdtemp(prefix="cowtune-store-"))
    with tarfile.open(store) as tar:
        tar.extractall(folder, filter="data")
    return folder


def runs_of(folder: Path, search: str) -> tuple[str, list[dict]]:
    """The search's newest parent run and its runs (trials and confirm runs, less orphans), as ``cowtune promote``
    finds them."""
    from mlflow.tracking import MlflowClient

    from trainables.search import mlflow_runs
    from trainables.search.promote import latest_parent

    uri = f"sqlite:///{folder / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment_id, parent = latest_parent(client, search)
    out = []
    for r in sorted(mlflow_runs.child_runs(uri, experiment_id, parent.info.run_id), key=lambda r: r.info.start_time):
        if not any(m in r.data.metrics for m in CURVES):
            continue
        curves = {}
        for metric in CURVES:
            history = sorted(client.get_metric_history(r.info.run_id, metric), key=lambda m: m.step)
            curves[metric] = [round(m.value, 6) for m in history]
        tags = r.data.tags
        params = {k: v for k, v in r.data.params.items() if not k.startswith(("train.", "data."))}
        out.append({"run_id": r.info.run_id, "name": r.info.run_name,
                    "stage": tags.get(mlflow_runs.STAGE_TAG, "search"),
                    "candidate": tags.get(CANDIDATE_TAG), "seed": tags.get(SEED_TAG, params.get("seed")),
                    "params": params, "epochs": len(curves[CURVES[0]]), "curves": curves})
    return parent.info.run_id, out


def plot(record: dict, out: Path, names: dict[str, str]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    confirm = [r for r in record["runs"] if r["stage"] == "confirm"]
    labels = sorted({r["candidate"] for r in confirm}, key=lambda c: (c != "paper", c))
    if not labels:
        raise SystemExit("no confirm runs to plot")
    fig, axes = plt.subplots(1, len(labels), figsize=(5 * len(labels), 4.2), sharey=True, squeeze=False)
    for ax, label in zip(axes[0], labels):
        for r in sorted((r for r in confirm if r["candidate"] == label), key=lambda r: int(r["seed"])):
            y = [100 * v for v in r["curves"]["val/error_teacher_mean3"]]
            ax.plot(range(1, len(y) + 1), y, label=f"seed {r['seed']}: {y[-1]:.2f}%")
        ax.set_title(names.get(label, label))
        ax.set_xlabel("epoch")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("teacher error on the holdout, mean of 3 epochs (%)")
    fig.suptitle(f"{record['search']}: the confirm stage, {record['gpu']}, {record['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store", type=Path)
    parser.add_argument("--search", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--png", type=Path)
    parser.add_argument("--name", action="append", default=[], metavar="ID=NAME",
                        help="a panel's title for a finalist (e.g. 2e94494f='steady (2e94494f)'); repeatable")
    for key in ("what", "gpu", "date", "commit", "data"):
        parser.add_argument(f"--{key}", default="")
    args = parser.parse_args()
    parent, runs = runs_of(open_store(args.store), args.search)
    record = {"search": args.search, "what": args.what, "gpu": args.gpu, "date": args.date, "commit": args.commit,
              "data": args.data, "parent_run": parent, "runs": runs}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}: {len(runs)} runs "
          f"({sum(r['stage'] == 'confirm' for r in runs)} of the confirm stage)")
    if args.png:
        plot(record, args.png, dict(n.split("=", 1) for n in args.name))


if __name__ == "__main__":
    main()
