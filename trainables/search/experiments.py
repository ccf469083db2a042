"""Driver-side pieces shared by a search (``trainables.search.driver``) and a final job (``trainables.search.final``):
start Ray, open or re-open the MLflow parent run and the Ray experiment, close each trial's child run.

What a search or final job computes, recorded with its MLflow parent run and compared when the same name
runs again: a job restored with other settings is refused, naming the fields that differ, before Ray starts.

A search driver stopped by SIGTERM (``kill PID``, a scheduler's time limit) or Ctrl-C: one short summary, and the
same command resumes.

Ray's core installs a C++ SIGTERM handler in the driver at ``ray.init``: it prints "*** SIGTERM received at time=..."
with a stack dump and aborts (exit status 134), leaving the Ray experiment at its last periodic snapshot and the MLflow
parent run RUNNING. Ray Tune stops a run cleanly on SIGINT or SIGUSR1 (the trials stop, the experiment state is
saved, ``fit()`` returns), but then the driver cannot tell a stopped search from a finished one: it went on to
summarise, confirm and say "done".

``stop_cleanly`` (after ``ray.init``, for ``fit()``) takes SIGTERM and SIGINT in the driver and hands each to Tune's
clean stop (its SIGUSR1 handler, installed while ``fit()`` runs; Tune's own SIGINT handler is left out with
``TUNE_DISABLE_SIGINT_HANDLER``, so the driver knows which signal it was); a second signal, or one outside ``fit()``,
stops at once (KeyboardInterrupt). ``stopped_by`` then names the signal, or is None.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import ray
from mlflow.entities import Param
from mlflow.tracking import MlflowClient
from ray import tune

from trainables import metrics as M
from trainables.config import todays_key
from trainables.file_locks import hold_job_lock
from trainables.search import mlflow_runs
from trainables.search.mlflow_runs import is_outage
from trainables.search.trial import CURVE_FILE, META, REFUSED, learning_curve_png
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
    (``trial.train_trial``), before any data, model or MLflow run. Ray's traceback of it is left out."""

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
        if not sys.stdout.isatty():   # the trials' forwarded lines into a log file or a pipe: no ANSI colour codes
            os.environ.setdefault("RAY_COLOR_PREFIX", "0")
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
    which ``check_resumable`` compares: callers run it first, before any process starts.
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


TRACKING_TIMEOUT_S = 5.0


def check_tracking_server(uri: str | None = None, timeout: float = TRACKING_TIMEOUT_S) -> str:
    """The tracking URI, checked to answer within ``timeout`` when it is a server (http/https), before any job
    starts: an unreachable one is one ConfigError line, not minutes of MLflow's retries ending in tracebacks."""
    import urllib.error
    import urllib.request

    uri = uri or mlflow_runs.resolve_tracking_uri()
    if uri.startswith(("http://", "https://")):
        try:
            urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout).close()
        except urllib.error.HTTPError:
            pass   # it answered: a server without /health, or behind a proxy asking for a login
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ConfigError(f"the MLflow tracking server {uri} (MLFLOW_TRACKING_URI) did not answer within "
                              f"{timeout:g} s ({reason}): start it, or unset MLFLOW_TRACKING_URI to record into "
                              "./mlflow.db") from None
    return uri


def lock_job(name: str, storage: str, what: str) -> None:
    """Hold the job's lock for the rest of this process: a second search or final job of this name on this storage
    is refused, naming the process that runs it (local or shared folders; not object-store URIs)."""
    if "://" not in storage:
        folder = Path(storage).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        hold_job_lock(folder / f".{name}.cowtune-lock", f"{what} {name} in {folder}")


def experiment_path(name: str, storage: str) -> str:
    return f"{storage}/{name}" if "://" in storage else str(Path(storage).resolve() / name)


def check_resumable(name: str, storage: str, tags: dict[str, str], settings: dict[str, Any],
                    growable: bool = False) -> None:
    """What ``open_experiment`` checks before it restores a job, early (before Ray or any process starts, and
    creating nothing): raises ConfigError if a job of this name exists with other settings (``growable``: a
    search whose study is in a database may ask for more trials than it ran)."""

    uri = mlflow_runs.resolve_tracking_uri()
    experiment = MlflowClient(uri).get_experiment_by_name(name)
    exp_path = experiment_path(name, storage)
    if experiment is None or not tune.Tuner.can_restore(exp_path):
        return
    parent = mlflow_runs.find_parent(uri, experiment.experiment_id, exp_path)
    if parent is not None:
        grows = growable and int(settings.get(GROWS, 0)) > int(parent.data.params.get(GROWS, "0") or 0)
        check_same_settings(exp_path, parent, setting_params(settings), tags, ignore=(GROWS,) if grows else ())


MAX_PARAM = 500   # characters of a setting's value kept as an MLflow parameter (MLflow takes up to 6,000)


def setting_params(settings: dict[str, Any]) -> dict[str, str]:
    """``settings`` as MLflow parameters: each value as text, a long one cut with a hash of the whole (so a
    difference still shows)."""
    out = {}
    for key, value in settings.items():
        text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
        if len(text) > MAX_PARAM:
            text = text[:MAX_PARAM - 20] + "...#" + hashlib.sha256(text.encode()).hexdigest()[:12]
        out[key] = text
    return out


GROWS = "search.trials"   # the one setting a search with its study in a database may raise when run again


def check_same_settings(exp_path: str, parent: Any, params: dict[str, str], tags: dict[str, str],
                        ignore: tuple[str, ...] = ()) -> None:
    """Raises ConfigError unless the job recorded under ``parent`` has these settings (``setting_params``)."""
    old = params_in_todays_layout(dict(parent.data.params))
    if old and params:
        differ = sorted(k for k in set(old) | set(params) if old.get(k) != params.get(k) and k not in ignore)
        if not differ:
            return
        shown = ", ".join(f"{k} ({old.get(k, 'unset')} -> {params.get(k, 'unset')})" for k in differ[:6])
        more = f" and {len(differ) - 6} more" if len(differ) > 6 else ""
    elif parent.data.tags.get("cowtune.fingerprint") == tags.get("cowtune.fingerprint"):
        return
    else:
        shown, more = "fields not recorded by the version that started it", ""
    raise ConfigError(f"{exp_path} was started with other settings (differs in: {shown}{more}); run it with its "
                      "own settings to resume it, or pass --name NEW to start another")


def params_in_todays_layout(recorded: dict[str, str]) -> dict[str, str]:
    """A job's recorded parameters with the config's keys in today's spelling (``config.train.compile`` of the
    layout before 2026-12-03 is ``config.train.fast.compile``: ``trainables.config.todays_key``), so a search recorded
    before the speed settings moved resumes with its own settings instead of differing in every speed key."""
    prefix = "config."
    return {prefix + todays_key(k[len(prefix):], switch=v in ("true", "false")) if k.startswith(prefix) else k: v
            for k, v in recorded.items()}


def log_params(uri: str, run_id: str, params: dict[str, str]) -> None:
    """Log ``params`` on a run, 100 a request (MLflow's limit)."""
    client = MlflowClient(uri)
    items = sorted(params.items())
    for i in range(0, len(items), 100):
        client.log_batch(run_id, params=[Param(k, v) for k, v in items[i:i + 100]])


TUNE_SIGINT_ENV = "TUNE_DISABLE_SIGINT_HANDLER"
_STOPPED: dict[str, str] = {}
NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C (SIGINT)"}


def _stop(signum: int, frame: Any) -> None:
    tune_stop = signal.getsignal(signal.SIGUSR1) if hasattr(signal, "SIGUSR1") else None
    if "by" in _STOPPED or not callable(tune_stop):   # a second signal, or no fit() running: stop now
        raise KeyboardInterrupt
    _STOPPED["by"] = NAMES.get(signum, f"signal {signum}")
    tune_stop(signum, frame)   # Tune: stop the trials, save the experiment state, return from fit()


def stop_cleanly() -> None:
    """SIGTERM and SIGINT to Tune's clean stop from now on (the main thread only; elsewhere nothing changes)."""
    _STOPPED.clear()
    os.environ[TUNE_SIGINT_ENV] = "1"
    for sig in NAMES:
        try:
            signal.signal(sig, _stop)
        except ValueError:   # not the main thread: signals cannot be taken here
            return


def stopped_by() -> str | None:
    return _STOPPED.get("by")
