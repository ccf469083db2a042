"""Wall time of a whole search: the real search script, Ray Tune, Optuna, ASHA, MLflow and evaluation.

``python benchmarks/throughput.py --search 16 --epochs 30 --data DIR`` runs
``search_spaces/cifar10_cowmix.py`` with WRN-28-2 in a fresh working folder (embedded MLflow on
SQLite there, Ray results there), times it from launch to exit, and reads back from MLflow what
each trial did: epochs trained, whether ASHA stopped it, its final holdout error.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_search_timed(trials: int, epochs: int, data: str | None, model: str, tiny: bool,
                     extra: list[str]) -> dict[str, Any]:
    """Run the CowMix search script once; return wall time and what MLflow recorded per trial."""
    from mlflow.tracking import MlflowClient

    from trainables import metrics as M
    from trainables.search.mlflow_runs import PARENT_TAG, TRIAL_TAG

    work = Path(tempfile.mkdtemp(prefix="cowtune-search-bench-"))
    cmd = [sys.executable, str(ROOT / "search_spaces" / "cifar10_cowmix.py"), "--trials", str(trials),
           "--epochs", str(epochs), "--name", "search-bench", "--storage", str(work / "ray_results"),
           "--no-confirm"]   # the search's own wall time; the confirm stage is as many full runs again
    cmd += ["--smoke-test"] if tiny else ["--set", f"model={model}"]
    if data:
        cmd += ["--data", str(Path(data).resolve())]
        if not (Path(data) / "cifar-10-batches-py").is_dir():   # a JPEG zip or ImageFolder tree of CIFAR-10
            cmd += ["--set", "data.dataset=imagefolder"]
    cmd += extra
    # embedded MLflow store in `work` and a private local Ray, whatever this shell points at
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    print(f"# search: {' '.join(cmd[1:])}\n# working folder {work}", flush=True)
    t0, launched = time.perf_counter(), time.time()
    proc = subprocess.run(cmd, cwd=work, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"search failed with exit status {proc.returncode} after {wall:.0f} s")
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    exp = client.get_experiment_by_name("search-bench")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    children = [r for r in runs if PARENT_TAG in r.data.tags]
    rows = []
    for r in children:
        err = r.data.metrics.get(M.VAL_ERROR_TEACHER)
        # seconds after launch: the trial's MLflow run opened, and each epoch's report
        history = client.get_metric_history(r.info.run_id, M.STEPS_PER_S)
        reports = sorted(m.timestamp / 1e3 - launched for m in history)
        rates = sorted(m.value for m in history)
        phases = {key: {int(m.step): m.value for m in client.get_metric_history(r.info.run_id, key)}
                  for key in (M.TRAIN_S, M.EVAL_S, M.CHECKPOINT_S, M.FIRST_STEP_S, M.COMPILE_WAIT_S)}
        rows.append({"trial": r.data.tags.get(TRIAL_TAG, "?"),
                     "epochs": int(r.data.tags.get("cowtune.final_epoch", "0")),
                     "stopped_early": r.data.tags.get("cowtune.stopped_early") == "True",
                     "val_error_teacher": err, "status": r.info.status,
                     "opened_s": r.info.start_time / 1e3 - launched, "epoch_reports_s": reports,
                     "steps_per_s_median": rates[len(rates) // 2] if rates else None,
                     "first_step_s": next(iter(phases[M.FIRST_STEP_S].values()), None),
                     "compile_wait_s": next(iter(phases[M.COMPILE_WAIT_S].values()), None),
                     # an epoch after the first: its steps, evaluation, checkpoint, and the whole report-to-report cycle
                     "epoch_phases_s_median": {
                         "train": _median([v for e, v in phases[M.TRAIN_S].items() if e > 1]),
                         "eval": _median(list(phases[M.EVAL_S].values())),
                         "checkpoint": _median(list(phases[M.CHECKPOINT_S].values())),
                         "cycle": _median([b - a for a, b in zip(reports[1:], reports[2:])])}})
    return {"wall_s": wall, "trials": rows, "working_folder": str(work), "timeline": timeline(rows, wall)}


def _median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


def timeline(rows: list[dict[str, Any]], wall: float) -> dict[str, float]:
    """Where the wall time went, from each trial's MLflow timestamps (seconds after launch)."""
    opened = [r["opened_s"] for r in rows]
    reports = [r["epoch_reports_s"] for r in rows if r["epoch_reports_s"]]
    if not opened or not reports:
        return {}
    first_epochs = [rep[0] - r["opened_s"] for r, rep in zip((r for r in rows if r["epoch_reports_s"]), reports)]
    return {"first_trial_opened_s": min(opened),           # Ray start-up, the driver's checks
            "first_epoch_reported_s": min(rep[0] for rep in reports),
            "median_open_to_first_epoch_s": sorted(first_epochs)[len(first_epochs) // 2],  # set-up + compile + epoch 1
            "last_epoch_reported_s": max(rep[-1] for rep in reports),
            "after_last_report_s": wall - max(rep[-1] for rep in reports)}   # trial shutdown, driver's summary


def print_search(result: dict[str, Any], epochs: int) -> None:
    rows = result["trials"]
    full = [r for r in rows if r["epochs"] >= epochs]
    stopped = [r for r in rows if r["stopped_early"]]
    errors = [r["val_error_teacher"] for r in rows if r["val_error_teacher"] is not None]
    print(f"\n{'trial':>10}  {'epochs':>6}  {'ASHA stop':>9}  {'val err (teacher)':>17}  status")
    for r in sorted(rows, key=lambda r: (r["val_error_teacher"] is None, r["val_error_teacher"] or 0)):
        err = f"{100 * r['val_error_teacher']:.2f}%" if r["val_error_teacher"] is not None else "-"
        print(f"{r['trial']:>10}  {r['epochs']:>6}  {'yes' if r['stopped_early'] else 'no':>9}  {err:>17}  {r['status']}")
    t = result.get("timeline") or {}
    if t:
        print(f"\ntimeline: first trial opened at {t['first_trial_opened_s']:.0f} s, first epoch reported at "
              f"{t['first_epoch_reported_s']:.0f} s (a trial's set-up, compilation and first epoch: median "
              f"{t['median_open_to_first_epoch_s']:.0f} s), last epoch reported at {t['last_epoch_reported_s']:.0f} s, "
              f"exit {t['after_last_report_s']:.0f} s later")
    firsts = [(r["first_step_s"], r["compile_wait_s"]) for r in rows if r.get("first_step_s") is not None]
    if firsts:
        print("first steps (compilation, cuDNN tuning, graph capture), least waiting first: "
              + ", ".join(f"{f:.0f} s" + (f" after {w:.0f} s waiting" if w >= 0.5 else "")
                          for f, w in sorted(firsts, key=lambda fw: fw[1])[:8]))
    phases = [r["epoch_phases_s_median"] for r in rows if r.get("epoch_phases_s_median", {}).get("cycle")]
    if phases:
        med = {k: _median([p[k] for p in phases if p[k] is not None]) for k in ("train", "eval", "checkpoint", "cycle")}
        rest = med["cycle"] - med["train"] - med["eval"] - med["checkpoint"]
        print(f"a trial's epoch (medians): steps {med['train']:.2f} s, evaluation {med['eval']:.2f} s, checkpoint "
              f"{med['checkpoint']:.2f} s, report and logging {rest:.2f} s; {med['cycle']:.2f} s report to report")
    print(f"\nwall time {result['wall_s'] / 60:.1f} min for {len(rows)} trials: {len(full)} ran all {epochs} epochs, "
          f"{len(stopped)} stopped by ASHA, {sum(r['epochs'] for r in rows)} trial-epochs in all"
          + (f"; best holdout error {100 * min(errors):.2f}%" if errors else ""), flush=True)
