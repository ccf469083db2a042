"""MLflow glue: one parent run per search, one child run per trial (``TrialRun``), re-attached after a restore.

Everything goes through ``MlflowClient`` with explicit run ids (no fluent "active run"), so Ray worker processes never
share hidden global state and an ``MLFLOW_RUN_ID`` in the environment cannot redirect a trial (mlflow/mlflow#15713).
Embedded default: without ``MLFLOW_TRACKING_URI`` the store is ``sqlite:///<cwd>/mlflow.db`` with artifacts in
``<cwd>/mlartifacts``; open it with ``mlflow ui --backend-store-uri sqlite:///mlflow.db``.

A trial's MLflow records while the tracking server does not answer: kept on disk, delivered in order later.

Every record of a trial's run (an epoch's metrics, tags, an artifact, its end) goes through its ``Outbox``. While
the server answers, a record is delivered at once. When it does not (refused, timed out, a 5xx), the record is
appended to ``mlflow_outbox.jsonl`` in the trial's folder, which travels with its checkpoints, and training goes
on; later records queue behind it, and delivery is tried again at most every ``RETRY_S`` seconds, oldest first,
so MLflow receives every epoch once and in order. An artifact waiting in the outbox is copied into it first.
A trial that ends with records still waiting keeps its outbox on disk; ``cowtune upload DIR`` delivers it.

The MLflow child run of one trial: created or re-attached at the trial's start, fed through an ``Outbox``.

Re-attaches through the run id kept in the trial's checkpoint folder, or through the trial id tag (a trial restarted
before its first checkpoint); never logs an epoch twice (one MLflow already holds, or one waiting in the outbox).
While the tracking server is away the trial trains on and its records wait (``Outbox``); a trial
that ends before the server returns keeps them in ``outbox_home()`` and says how to upload them.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable
from urllib.parse import unquote, urlparse

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from requests.exceptions import RequestException

from trainables.checkpoints import write_text
from trainables.validation import flatten

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


OUTBOX = "mlflow_outbox.jsonl"
FILES = "mlflow_outbox_files"
RETRY_S = 15.0
# A worker's MLflow calls give up after a few seconds while the server is away (MLflow's defaults retry for
# about two minutes per call, holding training that long); the user's own settings win.
QUICK_CLIENT = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
_OUTAGE_WORDS = ("Max retries exceeded", "Connection refused", "ConnectionError", "timed out", "Temporary failure",
                 "Name or service not known", "503", "502", "504", "RemoteDisconnected", "Connection aborted")


def outbox_home() -> Path:
    """Where finished trials keep undelivered records, on the node that ran them: $COWTUNE_OUTBOX, or
    ~/.cowtune/mlflow-outbox."""
    return Path(os.environ.get("COWTUNE_OUTBOX") or Path.home() / ".cowtune" / "mlflow-outbox")


def quick_client() -> None:
    """Short MLflow retries for this process (unless set), and no console line per retry while the server is away."""
    for key, value in QUICK_CLIENT.items():
        os.environ.setdefault(key, value)
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)


def is_outage(exc: BaseException) -> bool:
    """A server that does not answer (or answers 5xx), as opposed to a request it refuses."""
    if isinstance(exc, (RequestException, ConnectionError, TimeoutError)):
        return True
    return isinstance(exc, MlflowException) and any(w in str(exc) for w in _OUTAGE_WORDS)


class Outbox:
    def __init__(self, client: MlflowClient, run_id: str, folder: Path, log=print):
        self.client, self.run_id, self.folder, self.log = client, run_id, Path(folder), log
        self.path = self.folder / OUTBOX
        self.pending: list[dict[str, Any]] = [json.loads(line) for line in self.path.read_text().splitlines()] \
            if self.path.exists() else []
        self.failed_at = float("-inf") if not self.pending else time.monotonic()

    def send(self, record: dict[str, Any]) -> None:
        """Deliver ``record`` after every earlier one, or keep it (and its file) until the server answers."""
        if not self.pending and self._try(record):
            return
        if record["op"] == "artifact":
            record = {**record, "path": self._keep_file(Path(record["path"]))}
        self.pending.append(record)
        self._save()
        if time.monotonic() - self.failed_at >= RETRY_S:
            self.flush()

    def flush(self) -> bool:
        """Deliver the waiting records, oldest first, until one fails; True when none is left."""
        while self.pending:
            if not self._try(self.pending[0]):
                return False
            self.pending.pop(0)
            self._save()
        shutil.rmtree(self.folder / FILES, ignore_errors=True)
        if self.failed_at > float("-inf"):
            self.log(f"MLflow answers again: every waiting record of run {self.run_id} is delivered")
        self.failed_at = float("-inf")
        return True

    def _try(self, record: dict[str, Any]) -> bool:
        try:
            deliver(self.client, self.run_id, record, self.folder)
            return True
        except Exception as exc:   # noqa: BLE001 - only an outage is kept; anything else is raised
            if not is_outage(exc):
                raise
            if self.failed_at == float("-inf"):
                self.log(f"MLflow at {self.client.tracking_uri} does not answer ({type(exc).__name__}); training goes "
                         f"on and its records wait in {self.path}, sent in order when it answers")
            self.failed_at = time.monotonic()
            return False

    def _keep_file(self, path: Path) -> str:
        """A copy of an artifact waiting in the outbox (its source may change or go), relative to the folder."""
        store = self.folder / FILES / f"{len(self.pending):05d}"
        store.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, store / path.name)
        return str((store / path.name).relative_to(self.folder))

    def _save(self) -> None:
        write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.pending))   # a full disk: named, kept whole
        if not self.pending:
            self.path.unlink(missing_ok=True)


def deliver(client: MlflowClient, run_id: str, record: dict[str, Any], folder: Path) -> None:
    op = record["op"]
    if op == "metrics":
        batch = [Metric(k, float(v), record["ts"], record["step"]) for k, v in record["values"].items()]
        for i in range(0, len(batch), 1000):
            client.log_batch(run_id, metrics=batch[i:i + 1000])
    elif op == "tags":
        client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in record["tags"].items()])
    elif op == "artifact":
        path = Path(record["path"])
        client.log_artifact(run_id, str(path if path.is_absolute() else folder / path), record.get("artifact_path"))
    elif op == "end":
        client.set_terminated(run_id, record["status"])
    else:
        raise ValueError(f"unknown outbox record {op!r}")


def keep(folder: Path, into: Path, header: dict[str, Any]) -> Path:
    """Move a trial's waiting records (and their files) to ``into``, a folder that outlives the trial, with the
    run they belong to: what ``cowtune upload`` reads."""
    into.mkdir(parents=True, exist_ok=True)
    for name in (OUTBOX, FILES):
        if (folder / name).exists():
            shutil.move(str(folder / name), str(into / name))
    write_text(into / "run.json", json.dumps(header, indent=1))
    return into


def upload(root: Path, log=print) -> tuple[int, int]:
    """Deliver every kept outbox under ``root``; (delivered, still waiting). A delivered one is removed."""
    quick_client()
    done = waiting = 0
    for box in sorted(p.parent for p in root.rglob(OUTBOX)):
        header = json.loads((box / "run.json").read_text())
        client = MlflowClient(header["uri"])
        outbox = Outbox(client, header["run_id"], box, log=lambda s: None)
        n = len(outbox.pending)
        outbox.failed_at = float("-inf")
        if outbox.flush():
            shutil.rmtree(box)
            log(f"{box}: {n} records delivered to run {header['run_id']} at {header['uri']}")
            done += 1
        else:
            log(f"{box}: MLflow at {header['uri']} does not answer; {len(outbox.pending)} records still wait")
            waiting += 1
    return done, waiting


RUN_ID_FILE = "mlflow_run_id.txt"      # kept in the trial checkpoint folder
FAILURE_TAG = "cowtune.failure"        # why a trial failed for good: a retry stops at once with it
MAX_PARAM_CHARS = 6000


class TrialRun:
    earlier_failure: str | None = None   # a re-attached run's FAILURE_TAG: why an earlier attempt failed for good

    def __init__(self, uri: str, experiment_id: str, parent_id: str, trial_id: str, trial_name: str,
                 out_dir: Path, config: dict[str, Any], tags: dict[str, str], log: Callable[[str], None] = print):
        quick_client()
        self.client, self.uri, self.name, self.experiment_id, self.log = MlflowClient(uri), uri, trial_name, \
            experiment_id, log
        id_file = out_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else None
        run_id = run_id or find_trial_run(uri, experiment_id, parent_id, trial_id)
        if run_id is None:
            run = self.client.create_run(experiment_id, run_name=trial_name,
                                         tags={PARENT_TAG: parent_id, TRIAL_TAG: trial_id, **tags})
            run_id = run.info.run_id
            params = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in flatten(config).items()]
            params += [Param(f"{k}.{end}", str(float(x))) for k, v in flatten(config).items() if _is_range(v)
                       for end, x in zip(("lo", "hi"), v)]   # numbers, for MLflow's compare and parallel views
            for i in range(0, len(params), 100):
                self.client.log_batch(run_id, params=params[i:i + 100])
            self.created = True
        else:
            self.earlier_failure = self.client.get_run(run_id).data.tags.get(FAILURE_TAG)
            self.client.update_run(run_id, status="RUNNING")
            self.created = False
        id_file.write_text(run_id)
        self.run_id, self.folder = run_id, out_dir
        self.outbox = Outbox(self.client, run_id, out_dir, log)
        self.logged = {int(m.step) for m in self.client.get_metric_history(run_id, "epoch")} | \
            {r["step"] for r in self.outbox.pending if r["op"] == "metrics"}
        self.outbox.flush()   # records an earlier attempt left waiting: the server answered just now

    def record_failure(self, exc: Exception) -> None:
        """Why the trial failed for good (its loss diverged, its device ran out of memory), on its run."""
        self.set_tags({FAILURE_TAG: f"{type(exc).__name__}: {exc}"})

    def set_tags(self, tags: dict[str, Any]) -> None:
        self.outbox.send({"op": "tags", "tags": {k: str(v) for k, v in tags.items()}})

    def log_epoch(self, epoch: int, metrics: dict[str, float]) -> bool:
        """Log one epoch's metrics at step=epoch; False (and nothing logged) if it is already there."""
        if epoch in self.logged:
            return False
        values = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        self.outbox.send({"op": "metrics", "step": epoch, "ts": int(1000 * time.time()), "values": values})
        self.logged.add(epoch)
        return True

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.outbox.send({"op": "artifact", "path": str(Path(path).resolve()), "artifact_path": artifact_path})

    def finish(self, status: str = "FINISHED") -> Path | None:
        """End the run; if MLflow is still away, keep its waiting records under ``outbox_home()`` (returned), say so."""
        self.outbox.send({"op": "end", "status": status})
        if self.outbox.flush():
            return None
        home = keep(self.folder, outbox_home() / f"{self.experiment_id}-{self.name}",
                      {"uri": self.uri, "run_id": self.run_id, "trial": self.name, "node": socket.gethostname()})
        self.log(f"MLflow at {self.uri} still does not answer: {len(self.outbox.pending)} records of this trial's run "
                 f"{self.run_id} are kept in {home} on {socket.gethostname()}; when it answers, run `cowtune upload "
                 f"{home.parent}` there (the trial's results are also in Ray's storage)")
        return home


def _is_range(value: Any) -> bool:
    """A (lo, hi) pair of numbers, as CowMask's sigma and proportion ranges."""
    return (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value))
