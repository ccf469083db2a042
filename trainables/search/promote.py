"""``cowtune promote``: a search's confirmed best config -> MLflow model registry + a config file.

A search with a confirm stage (``trainables.search.confirm``) promotes what that stage chose: the finalist whose
mean over fresh seeds beats the paper's config by a paired test and whose seeds agree and do not diverge, or the
paper's config itself when no finalist does (a lead that was seed luck is not promoted). The registered checkpoint
is that config's median seed. A search without one (``--no-confirm``, or an older search) ranks single-seed trials,
which is partly luck: promoting its best trial takes ``--unconfirmed``, and then "best" is the lowest final
objective among the trials that trained for the whole budget (``epoch`` == the search's epochs). The promoted
config is a plain ``TrainConfig`` YAML (``cowtune train`` and ``cowtune final`` read it) headed by comments naming
where it came from; a trial's CPU share (``train.threads``) is not part of it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml
from mlflow.tracking import MlflowClient

from trainables import metrics as M
from trainables.config import TrainConfig
from trainables.search import mlflow_runs
from trainables.search.experiments import check_tracking_server
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
    parents = [r for r in runs if mlflow_runs.PARENT_TAG not in r.data.tags]
    if not parents:
        raise ConfigError(f"search '{search}' has no parent run in {client.tracking_uri}")
    return exp.experiment_id, parents[0]


def confirmed(client: MlflowClient, parent: Any) -> dict[str, Any] | None:
    """The confirm stage's record on a search's parent run (``confirm.json``), or None."""
    if not parent.data.tags.get("cowtune.confirm.winner"):
        return None
    return json.loads(mlflow_runs.read_artifact(client, parent, "confirm.json"))


def promote(search: str, out: str | Path, alias: str = "champion", model_name: str | None = None,
            metric: str | None = None, unconfirmed: bool = False) -> dict[str, Any]:
    """Register the confirmed config's checkpoint under ``model_name@alias`` and write its config to ``out``: all or
    nothing (``out`` is checked before the registry is touched, and written by an atomic rename)."""
    out = writable_file(out, "--out")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")   # no download bars in the console
    uri = check_tracking_server()
    store = Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None
    if store is not None and not store.exists():   # MlflowClient would create an empty store here
        raise ConfigError(f"Unknown search '{search}': there is no MLflow store at {store} (no search was recorded "
                          "there); run `cowtune promote` in the folder the search ran in, or set MLFLOW_TRACKING_URI")
    client = MlflowClient(uri)
    experiment_id, parent = latest_parent(client, search)
    metric = metric or parent.data.tags.get("cowtune.objective", M.VAL_ERROR_TEACHER)
    children = mlflow_runs.child_runs(uri, experiment_id, parent.info.run_id)
    record = confirmed(client, parent)
    if record is not None:
        best, config, chosen = _confirmed_choice(client, record, search)
    elif not unconfirmed:
        raise ConfigError(f"search '{search}' (parent run {parent.info.run_id}) has no confirm stage: its trials ran "
                          "one seed each, so its best is partly seed luck. Run the search command again to confirm "
                          "its finalists on fresh seeds, or pass --unconfirmed to promote its single best trial")
    else:
        best, config, chosen = _best_trial(client, parent, children, metric, search)
    config = TrainConfig.from_dict(config).to_dict()   # still valid with this code version, in its layout
    config.get("train", {}).pop("threads", None)   # the trial's CPU share, not a property of the config
    name = model_name or search
    version = register_model(uri, best.info.run_id, name, alias, "checkpoint")
    info = {"search": search, "parent_run_id": parent.info.run_id, "run_id": best.info.run_id, **chosen,
            "model": f"models:/{name}@{alias}", "version": version,
            "trials": sum(1 for c in children if mlflow_runs.STAGE_TAG not in c.data.tags)}
    header = "".join(f"# {k}: {v}\n" for k, v in info.items())
    tmp_out = out.with_name(f".{out.name}.tmp")
    tmp_out.write_text(f"# Promoted by `cowtune promote`.\n{header}" + yaml.safe_dump(config, sort_keys=False))
    os.replace(tmp_out, out)
    client.set_tag(parent.info.run_id, "cowtune.promoted_run", best.info.run_id)
    client.set_tag(best.info.run_id, "cowtune.promoted", f"{name}@{alias} v{version}")
    return info


def _confirmed_choice(client: MlflowClient, record: dict[str, Any], search: str) -> tuple[Any, dict[str, Any],
                                                                                           dict[str, Any]]:
    """The confirm stage's winner: its median seed's run, its config (seed as the search's), what it measured."""
    row = next(r for r in record["rows"] if r["label"] == record["winner"])
    if not record.get("winner_run_id"):
        raise ConfigError(f"search '{search}': the confirm stage's winner {record['winner']} has no run to register")
    best = client.get_run(record["winner_run_id"])
    seeds = sorted(row["objective"], key=int)
    chosen = {"winner": "the paper's config (trial 1)" if record["winner"] == "paper" else f"trial {record['winner']}",
              "gate": row["verdict"], record["objective"]: f"{100 * row['mean']:.2f} +- {100 * row['std']:.2f}% over "
              f"seeds {', '.join(seeds)} (the confirm stage; median seed registered)"}
    if row["p_value"] is not None:
        chosen["p_vs_paper"] = f"{row['p_value']:.4f} (one-sided paired t-test)"
    return best, dict(record["winner_config"]), chosen


def _best_trial(client: MlflowClient, parent: Any, children: list[Any], metric: str,
                search: str) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """--unconfirmed: the single best full-budget trial."""
    budget = int(parent.data.tags.get("cowtune.epochs", "0"))
    full = [c for c in children if metric in c.data.metrics and int(c.data.metrics.get(M.EPOCH, -1)) == budget
            and mlflow_runs.STAGE_TAG not in c.data.tags]
    if not full:
        raise ConfigError(f"no trial of search '{search}' (parent run {parent.info.run_id}) trained for its full "
                          f"budget of {budget} epochs; nothing to promote")
    best = min(full, key=lambda c: (c.data.metrics[metric], c.info.start_time))   # ties: the trial started first
    config = yaml.safe_load(mlflow_runs.read_artifact(client, best, "config.yaml"))
    return best, config, {"trial_id": best.data.tags.get(mlflow_runs.TRIAL_TAG, ""), metric: best.data.metrics[metric],
                          "gate": "unconfirmed: one seed, partly luck", "trials_full_budget": len(full)}
