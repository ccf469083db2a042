"""MLflow glue: one parent run per search, one child run per trial (``trial_run.TrialRun``), re-attached after a restore.

Everything goes through ``MlflowClient`` with explicit run ids (no fluent "active run"), so Ray worker processes never
share hidden global state and an ``MLFLOW_RUN_ID`` in the environment cannot redirect a trial (mlflow/mlflow#15713).
Embedded default: without ``MLFLOW_TRACKING_URI`` the store is ``sqlite:///<cwd>/mlflow.db`` with artifacts in
``<cwd>/mlartifacts``; open it with ``mlflow ui --backend-store-uri sqlite:///mlflow.db``.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlparse
from typing import Any

from mlflow.entities import RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

PARENT_TAG = "mlflow.parentRunId"
TRIAL_TAG = "ray.trial_id"
ORPHAN_TAG = "cowtune.orphaned"       # a trial's run that the restored Ray experiment does not know
KIND_TAG = "mlflow.experimentKind"    # the MLflow UI's view of an experiment
STAGE_TAG = "cowtune.stage"           # "confirm": a run of the confirm stage (trainables.search.confirm), not a trial


def resolve_tracking_uri(workdir: str | Path | None = None) -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    return uri or f"sqlite:///{Path(workdir or os.getcwd()).resolve() / 'mlflow.db'}"


def is_embedded(uri: str) -> bool:
    return uri.startswith(("sqlite:", "file:")) or "://" not in uri


def read_artifact(client: MlflowClient, run: Any, path: str) -> str:
    """The text of ``run``'s artifact ``path``. A store moved after it was written (an embedded one brought back from a
    GPU machine as a tarball) still names the old artifact folder: the ``mlartifacts/`` beside its database is tried
    next, and when that fails too, one message says where it looked."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            return Path(client.download_artifacts(run.info.run_id, path, tmp)).read_text()
        except (MlflowException, OSError) as e:
            moved = _beside_the_database(str(client.tracking_uri), run.info.artifact_uri or "", path)
            if moved is not None and moved.is_file():
                return moved.read_text()
            from trainables.validation import ConfigError
            where = f" or {moved}" if moved is not None else ""
            raise ConfigError(f"run {run.info.run_id}'s artifact '{path}' is not at {run.info.artifact_uri}{where} "
                              f"({str(e).splitlines()[0]}); was the MLflow store moved without its mlartifacts/ "
                              "folder? Put it beside mlflow.db") from None


def _beside_the_database(uri: str, artifact_uri: str, path: str) -> Path | None:
    """``artifact_uri``'s part from ``mlartifacts/`` on, under the directory of an embedded ``sqlite:`` store."""
    marker = "/mlartifacts/"
    if not uri.startswith("sqlite:///") or not artifact_uri.startswith("file:") or marker not in artifact_uri:
        return None
    database = Path(uri[len("sqlite:///"):])
    recorded = unquote(urlparse(artifact_uri).path)
    return database.resolve().parent / "mlartifacts" / recorded.split(marker, 1)[1] / path


def git_sha() -> str:
    """The code's commit; in a copy of the tree without its .git (a GPU machine's), $COWTUNE_COMMIT says which."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return sha or os.environ.get("COWTUNE_COMMIT", "unknown")


def ensure_experiment(uri: str, name: str, workdir: str | Path | None = None) -> str:
    """Get or create the experiment once, on the driver, before any trial starts (no creation race)."""
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = (Path(workdir or os.getcwd()).resolve() / "mlartifacts" / name).as_uri() if is_embedded(uri) else None
    try:   # the UI opens it in its model-training view (MLflow 3 guesses "GenAI" for an experiment without a kind)
        return client.create_experiment(name, artifact_location=location, tags={KIND_TAG: "custom_model_development"})
    except MlflowException:   # another driver created it in between
        return client.get_experiment_by_name(name).experiment_id


def start_parent(uri: str, experiment_id: str, name: str, tags: dict[str, str], run_id: str | None = None) -> str:
    """A new search parent run, or the given one re-opened after a restore."""
    client = MlflowClient(uri)
    if run_id:
        client.update_run(run_id, status="RUNNING")
    return run_id or client.create_run(experiment_id, run_name=name, tags=tags).info.run_id


def finish_run(uri: str, run_id: str, status: str = "FINISHED", tags: dict[str, str] | None = None) -> None:
    MlflowClient(uri).log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in (tags or {}).items()])
    MlflowClient(uri).set_terminated(run_id, status)


def child_runs(uri: str, experiment_id: str, parent_id: str) -> list[Any]:
    """The trials' runs under a parent, less the orphans (``ORPHAN_TAG``)."""
    runs = MlflowClient(uri).search_runs([experiment_id], f"tags.`{PARENT_TAG}` = '{parent_id}'", max_results=5000)
    return [r for r in runs if ORPHAN_TAG not in r.data.tags]


def find_trial_run(uri: str, experiment_id: str, parent_id: str, trial_id: str) -> str | None:
    runs = [r for r in child_runs(uri, experiment_id, parent_id) if r.data.tags.get(TRIAL_TAG) == trial_id]
    return runs[0].info.run_id if runs else None


def find_parent(uri: str, experiment_id: str, experiment_path: str) -> Any | None:
    """The newest search parent run recorded for this Ray experiment folder, if any."""
    runs = MlflowClient(uri).search_runs([experiment_id], filter_string=f"tags.`cowtune.experiment_path` = '{experiment_path}'",
                                         order_by=["attributes.start_time DESC"], max_results=10)
    runs = [r for r in runs if PARENT_TAG not in r.data.tags]
    return runs[0] if runs else None


def log_run_artifact(uri: str, run_id: str, path: str | Path) -> None:
    MlflowClient(uri).log_artifact(run_id, str(path))
