"""``cowtune promote``: the best full-budget trial of a search -> MLflow model registry + a config file.

"Best" is the lowest final validation teacher error among the trials that trained for the whole
budget (``epoch`` == the search's epochs); a trial ASHA stopped early is never promoted, since its
last error was measured at a smaller budget. The promoted config is a plain ``TrainConfig`` YAML
(``cowtune train`` and ``cowtune final`` read it) headed by comments naming where it came from.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import yaml
from mlflow.tracking import MlflowClient

from trainables import metrics as M
from trainables.config import TrainConfig
from trainables.search import tracking
from trainables.search.job_settings import check_tracking_server
from trainables.validation import ConfigError, writable_file


def register_model(uri: str, run_id: str, name: str, alias: str, artifact_path: str) -> str:
    """Register ``runs:/<run_id>/<artifact_path>`` as a new version of ``name`` and point ``alias`` at it."""
    client = MlflowClient(uri)
    if not client.search_registered_models(filter_string=f"name = '{name}'"):
        client.create_registered_model(name)
    version = client.create_model_version(name, f"runs:/{run_id}/{artifact_path}", run_id=run_id)
    client.set_registered_model_alias(name, alias, version.version)
    return version.version


def latest_parent(client: MlflowClient, search: str) -> tuple[str, Any]:
    exp = client.get_experiment_by_name(search)
    if exp is None:
        names = [e.name for e in client.search_experiments()]
        raise ConfigError(f"Unknown search '{search}' in {client.tracking_uri}. Known: {', '.join(sorted(names))}.")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`cowtune.search` != ''",
                              order_by=["attributes.start_time DESC"], max_results=50)
    parents = [r for r in runs if tracking.PARENT_TAG not in r.data.tags]
    if not parents:
        raise ConfigError(f"search '{search}' has no parent run in {client.tracking_uri}")
    return exp.experiment_id, parents[0]


def promote(search: str, out: str | Path, alias: str = "champion", model_name: str | None = None,
            metric: str = M.VAL_ERROR_TEACHER) -> dict[str, Any]:
    """Register the best trial's checkpoint under ``model_name@alias`` and write its config to ``out``: all or
    nothing (``out`` is checked before the registry is touched, and written by an atomic rename)."""
    out = writable_file(out, "--out")
    uri = check_tracking_server()
    store = Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None
    if store is not None and not store.exists():   # MlflowClient would create an empty store here
        raise ConfigError(f"Unknown search '{search}': there is no MLflow store at {store} (no search was recorded "
                          "there); run `cowtune promote` in the folder the search ran in, or set MLFLOW_TRACKING_URI")
    client = MlflowClient(uri)
    experiment_id, parent = latest_parent(client, search)
    budget = int(parent.data.tags.get("cowtune.epochs", "0"))
    children = tracking.child_runs(uri, experiment_id, parent.info.run_id)
    full = [c for c in children if metric in c.data.metrics and int(c.data.metrics.get(M.EPOCH, -1)) == budget]
    if not full:
        raise ConfigError(f"no trial of search '{search}' (parent run {parent.info.run_id}) trained for its full "
                          f"budget of {budget} epochs; nothing to promote")
    best = min(full, key=lambda c: c.data.metrics[metric])
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = client.download_artifacts(best.info.run_id, "config.yaml", tmp)
        config = yaml.safe_load(Path(cfg_path).read_text())
    TrainConfig.from_dict(config)   # still valid with this code version
    name = model_name or search
    version = register_model(uri, best.info.run_id, name, alias, "checkpoint")
    info = {"search": search, "parent_run_id": parent.info.run_id, "run_id": best.info.run_id,
            "trial_id": best.data.tags.get(tracking.TRIAL_TAG, ""), metric: best.data.metrics[metric],
            "model": f"models:/{name}@{alias}", "version": version, "trials_full_budget": len(full),
            "trials": len(children)}
    header = "".join(f"# {k}: {v}\n" for k, v in info.items())
    tmp_out = out.with_name(f".{out.name}.tmp")
    tmp_out.write_text(f"# Promoted by `cowtune promote`.\n{header}" + yaml.safe_dump(config, sort_keys=False))
    os.replace(tmp_out, out)
    client.set_tag(parent.info.run_id, "cowtune.promoted_run", best.info.run_id)
    client.set_tag(best.info.run_id, "cowtune.promoted", f"{name}@{alias} v{version}")
    return info
