"""A trial's MLflow records while the tracking server does not answer: kept on disk, delivered in order later.

Every record of a trial's run (an epoch's metrics, tags, an artifact, its end) goes through its ``Outbox``. While
the server answers, a record is delivered at once. When it does not (refused, timed out, a 5xx), the record is
appended to ``mlflow_outbox.jsonl`` in the trial's folder, which travels with its checkpoints, and training goes
on; later records queue behind it, and delivery is tried again at most every ``RETRY_S`` seconds, oldest first,
so MLflow receives every epoch once and in order. An artifact waiting in the outbox is copied into it first.
A trial that ends with records still waiting keeps its outbox on disk; ``cowtune upload DIR`` delivers it.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from requests.exceptions import RequestException

from trainables.checkpoints import write_text

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
