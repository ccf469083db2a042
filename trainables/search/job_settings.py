"""What a search or final job computes, recorded with its MLflow parent run and compared when the same name
runs again: a job restored with other settings is refused, naming the fields that differ, before Ray starts."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from mlflow.entities import Param
from mlflow.tracking import MlflowClient

from trainables.config import todays_key
from trainables.file_locks import hold_job_lock
from trainables.search import mlflow_runs
from trainables.validation import ConfigError


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
    from ray import tune   # here: promote, which checks the tracking server with this module, never starts Ray

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
