"""Driver-side pieces shared by a search (``trainables.search.driver``) and a final job (``trainables.search.final_job``):
start Ray, open or re-open the MLflow parent run and the Ray experiment, close each trial's child run."""
from __future__ import annotations

import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import ray
from mlflow.tracking import MlflowClient
from ray import tune

from trainables import metrics as M
from trainables.search.trial import CURVE_FILE, learning_curve_png
from trainables.search import mlflow_runs
from trainables.search.mlflow_runs import is_outage
from trainables.search.job_settings import experiment_path, log_params, setting_params
from trainables.search.trial import META, REFUSED
from trainables.validation import ConfigError

TUNE_CONTROLLER = "ray.tune.execution.tune_controller"   # logs "Trial task failed" with the traceback
CONFIG_ERROR = f"{ConfigError.__module__}.{ConfigError.__qualname__}: "   # how a trial's error file ends with one


def config_error(trial: Any) -> str | None:
    """The message of the ConfigError the trial's last attempt raised (its error file's last line), else None."""
    try:
        last = Path(trial.error_file).read_text().strip().splitlines()[-1].strip()
    except (OSError, TypeError, IndexError):   # no error file (yet), or an empty one
        return None
    return last[len(CONFIG_ERROR):] if last.startswith(CONFIG_ERROR) else None


def _quiet_config_errors(record: logging.LogRecord) -> bool:   # Ray raises a RayTaskError that is a ConfigError
    return not (record.exc_info and isinstance(record.exc_info[1], ConfigError))


class FinishChildRuns(tune.Callback):
    """Driver side: close each trial's MLflow run, also when ASHA stopped it mid-training, after drawing its
    final learning curve from what MLflow recorded (a trial redraws its own at most every 30 s). A ``ConfigError``
    would recur, but Ray retries any failure (max_failures; no per-exception policy in 2.60): when it queues such a
    trial again, its retries go and its config carries the message (``REFUSED``): that attempt stops at once
    (``tune_trainable.train_trial``), before any data, model or MLflow run. Ray's traceback of it is left out."""

    def __init__(self, uri: str, experiment_id: str, parent_id: str, full_epochs: int):
        self.uri, self.experiment_id, self.parent_id, self.full_epochs = uri, experiment_id, parent_id, full_epochs

    def setup(self, **info: Any) -> None:
        logging.getLogger(TUNE_CONTROLLER).addFilter(_quiet_config_errors)

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        logging.getLogger(TUNE_CONTROLLER).removeFilter(_quiet_config_errors)

    def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        if (message := config_error(trial)) is not None and isinstance(trial.config.get(META), dict):
            trial.max_failures = 0   # the attempt Tune has queued is the last
            trial.config[META] = {**trial.config[META], REFUSED: message}

    def _finish(self, trial: Any, status: str) -> None:
        try:
            run_id = mlflow_runs.find_trial_run(self.uri, self.experiment_id, self.parent_id, trial.trial_id)
            last = int(trial.last_result.get(M.EPOCH, 0))
            if run_id:
                final_curve(self.uri, run_id)
                mlflow_runs.finish_run(self.uri, run_id, status, {"cowtune.final_epoch": str(last),
                                                               "cowtune.stopped_early": str(last < self.full_epochs)})
        except Exception as exc:   # noqa: BLE001 - MLflow away: the trial's own outbox ends its run when it answers
            if not is_outage(exc):
                raise
            print(f"MLflow at {self.uri} does not answer: trial {trial.trial_id}'s run is closed by its own records "
                  "when it answers", flush=True)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._finish(trial, "FINISHED")

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._finish(trial, "FAILED")


def final_curve(uri: str, run_id: str) -> None:
    """Log the run's learning curve over every epoch MLflow has; a failure only warns (the metrics are there)."""
    try:
        name, rows = epoch_rows(uri, run_id)
        if rows:
            with tempfile.TemporaryDirectory() as d:
                mlflow_runs.log_run_artifact(uri, run_id, learning_curve_png(rows, Path(d) / CURVE_FILE, name))
    except Exception as e:   # noqa: BLE001 - a plot must never end a search
        warnings.warn(f"learning curve of MLflow run {run_id} not drawn: {type(e).__name__}: {e}", stacklevel=1)


def epoch_rows(uri: str, run_id: str) -> tuple[str, list[dict[str, float]]]:
    """A run's name and its metrics as one row per epoch ({"epoch": e, key: value, ...}), from MLflow."""
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    rows: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run_id, key):
            rows.setdefault(int(m.step), {"epoch": int(m.step)})[key] = m.value
    return run.info.run_name, [rows[e] for e in sorted(rows)]


def init_ray() -> None:
    """Join RAY_ADDRESS when set (a cluster, `ray job submit`), else start Ray locally on loopback."""
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init()
        else:
            ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False)   # never a stale `ray start`


def open_experiment(name: str, storage: str, tags: dict[str, str], settings: dict[str, Any] | None = None,
                    rounds: list[str] | None = None) -> tuple[str, str, str, str, bool]:
    """The MLflow experiment and parent run and the Ray experiment path of a search or final job: both
    re-opened when the Ray experiment can be restored. Returns (uri, experiment id, experiment path,
    parent run id, restoring).

    ``settings`` (flat: field -> value) say what the job computes; a new parent run records them as its parameters,
    which ``job_settings.check_resumable`` compares: callers run it first, before any process starts.
    ``rounds``: a search's Ray experiments (``studies.Round``), this run's last; one parent run holds them all."""
    uri = mlflow_runs.resolve_tracking_uri()
    experiment_id = mlflow_runs.ensure_experiment(uri, name)
    exp_path = experiment_path(name, storage)
    rounds = rounds or [exp_path]
    restoring = tune.Tuner.can_restore(rounds[-1])
    parent = mlflow_runs.find_parent(uri, experiment_id, exp_path) if restoring or len(rounds) > 1 else None
    init_ray()
    parent_id = mlflow_runs.start_parent(uri, experiment_id, name, {**tags, "cowtune.experiment_path": exp_path},
                                      parent.info.run_id if parent is not None else None)
    if parent is None and settings:
        log_params(uri, parent_id, setting_params(settings))
    if parent is not None:
        end_orphaned_runs(uri, experiment_id, parent_id, [p for p in rounds if tune.Tuner.can_restore(p)])
    return uri, experiment_id, rounds[-1], parent_id, restoring


def end_orphaned_runs(uri: str, experiment_id: str, parent_id: str, exp_paths: list[str]) -> None:
    """End as KILLED, tagged ``cowtune.orphaned``, the runs of trials that the restored Ray experiment does not
    know: the driver died after the trial started and before Ray's next snapshot of the experiment (Ray takes
    one every 10 s or more), so Ray runs that slot again under a new trial id. Kept for the record; not a
    trial any more. The confirm stage's runs belong to its own Ray experiments (``trainables.search.confirm``)."""
    known = {t.trial_id for path in exp_paths for t in tune.ExperimentAnalysis(path).trials}
    for r in mlflow_runs.child_runs(uri, experiment_id, parent_id):
        if r.data.tags.get(mlflow_runs.TRIAL_TAG) not in known and mlflow_runs.STAGE_TAG not in r.data.tags:
            why = "the driver died before Ray saved this trial; Ray runs its slot again as another trial"
            mlflow_runs.finish_run(uri, r.info.run_id, "KILLED", {mlflow_runs.ORPHAN_TAG: why})
            print(f"MLflow run {r.info.run_id} (trial {r.data.tags.get(mlflow_runs.TRIAL_TAG)}): {why}; "
                  "ended as KILLED", flush=True)
