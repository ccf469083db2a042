"""The MLflow child run of one trial: created or re-attached at the trial's start, fed through an ``Outbox``.

Re-attaches through the run id kept in the trial's checkpoint folder, or through the trial id tag (a trial restarted
before its first checkpoint); never logs an epoch twice (one MLflow already holds, or one waiting in the outbox).
While the tracking server is away the trial trains on and its records wait (``trainables.search.outbox``); a trial
that ends before the server returns keeps them in ``outbox.outbox_home()`` and says how to upload them.
"""
from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any, Callable

from mlflow.entities import Param
from mlflow.tracking import MlflowClient

from trainables.search import outbox as O
from trainables.search.tracking import PARENT_TAG, TRIAL_TAG, find_trial_run
from trainables.validation import flatten

RUN_ID_FILE = "mlflow_run_id.txt"      # kept in the trial checkpoint folder
FAILURE_TAG = "cowtune.failure"        # why a trial failed for good: a retry stops at once with it
MAX_PARAM_CHARS = 6000


class TrialRun:
    earlier_failure: str | None = None   # a re-attached run's FAILURE_TAG: why an earlier attempt failed for good

    def __init__(self, uri: str, experiment_id: str, parent_id: str, trial_id: str, trial_name: str,
                 out_dir: Path, config: dict[str, Any], tags: dict[str, str], log: Callable[[str], None] = print):
        O.quick_client()
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
        self.outbox = O.Outbox(self.client, run_id, out_dir, log)
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
        home = O.keep(self.folder, O.outbox_home() / f"{self.experiment_id}-{self.name}",
                      {"uri": self.uri, "run_id": self.run_id, "trial": self.name, "node": socket.gethostname()})
        self.log(f"MLflow at {self.uri} still does not answer: {len(self.outbox.pending)} records of this trial's run "
                 f"{self.run_id} are kept in {home} on {socket.gethostname()}; when it answers, run `cowtune upload "
                 f"{home.parent}` there (the trial's results are also in Ray's storage)")
        return home


def _is_range(value: Any) -> bool:
    """A (lo, hi) pair of numbers, as CowMask's sigma and proportion ranges."""
    return (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value))
