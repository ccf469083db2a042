"""``cowtune promote``: a search's confirmed best config -> MLflow model registry + a config file.

A search with a confirm stage (``trainables.search.confirm``) promotes what that stage chose: the finalist whose
mean over fresh seeds beats the paper's config by a paired test and whose seeds agree and do not diverge, or the
paper's config itself when no finalist does (a lead that was seed luck is not promoted). The registered checkpoint
is that config's median seed. A search without one (``--no-confirm``, or an older search) ranks single-seed trials,
which is partly luck: promoting its best trial takes ``--unconfirmed``, and then "best" is the lowest final
objective among the trials that trained for the whole budget (``epoch`` == the search's epochs). The promoted
config is a plain ``TrainConfig`` YAML (``cowtune train`` and ``cowtune final`` read it) headed by comments naming
where it came from; a trial's CPU share (``train.threads``) is not part of it.

``cowtune confirm``: more fresh seeds for a search's confirm stage, judged again over every seed.

Three seeds tell a large gain from seed noise, not a small one: on WRN-28-2 at 60 epochs a 1.4-point gain with a
2.2-point spread of the paired differences passes the gate's paired test (alpha 0.1) one time in three with 3 seeds
and four times in five with 12 (docs/search.md, "Noise"). ``--seeds N`` brings the stage's leading finalist (or the
ones named) and the paper's config to N seeds each (the stage's first seed and those after it), reading everything
from MLflow: each config from one of its confirm runs, each finished (config, seed) run's objective and curve. Only
the missing runs train (a Ray Tune grid, restored like the stage's when the driver dies; the same command again
finishes what a crash left); the gate then judges the extended configs on all their seeds, and the parent run's
``confirm.json``, table and metrics are written again, so ``cowtune promote`` reads the new verdict. It needs the MLflow store only, not the search's Ray results, so a stage can grow
on another machine or another day.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml
from mlflow.tracking import MlflowClient

from trainables import metrics as M
from trainables.config import TrainConfig
from trainables.search import gate, mlflow_runs
from trainables.search.gate import REFERENCE, Candidate
from trainables.validation import ConfigError, check, writable_file


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
    from trainables.search.experiments import check_tracking_server   # here: promote never loads Ray (it imports it)

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


def run(args: argparse.Namespace) -> dict[str, Any]:
    from trainables.search import confirm as stage
    from trainables.search.experiments import check_tracking_server, init_ray, lock_job

    check(args.seeds >= 3, "--seeds", "be at least 3 (seeds per config in all)", args.seeds)
    check(args.gpu_share is None or 0 < args.gpu_share <= 1, "--gpu-share", "be in (0, 1]", args.gpu_share)
    cores = os.cpu_count() or 1
    check(args.cpus_per_trial >= 1 and (bool(os.environ.get("RAY_ADDRESS")) or args.cpus_per_trial <= cores),
          "--cpus-per-trial", f"be between 1 and this machine's {cores} cores", args.cpus_per_trial)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    uri = check_tracking_server()
    client = MlflowClient(uri)
    experiment_id, parent = latest_parent(client, args.search)
    record = confirmed(client, parent)
    if record is None:
        raise ConfigError(f"search '{args.search}' has no confirm stage to add seeds to: run the search command "
                          "(without --no-confirm) first")
    objective, epochs = record["objective"], int(parent.data.tags["cowtune.epochs"])
    metric, window = _metric_and_window(record)
    runs = [r for r in mlflow_runs.child_runs(uri, experiment_id, parent.info.run_id) if stage.is_confirm_run(r)]
    candidates = [_candidate(client, row, runs, objective, metric, window, epochs) for row in record["rows"]]
    racing = [next(c for c in candidates if c.label == REFERENCE), *_chosen(candidates, args.only)]
    configs = {c.label: _config(client, runs, c.label) for c in racing}
    first = min(s for c in candidates for s in c.objective)
    seeds = tuple(range(first, first + args.seeds))
    missing = [(c.label, s) for c in racing for s in seeds if s not in c.objective]
    storage = args.storage or os.environ.get("COWTUNE_STORAGE") or str(Path.cwd() / "ray_results")
    lock_job(args.search, storage, "search")   # not while the search itself runs
    t0 = time.monotonic()
    if missing:
        init_ray()
        key = hashlib.sha256(json.dumps([sorted(configs.items()), seeds], sort_keys=True, default=str).encode())
        plan = SimpleNamespace(base=configs[REFERENCE], epochs=epochs, name=args.search)
        print(f"confirm: {len(missing)} runs to bring the paper's config and {', '.join(c.label for c in racing[1:])} "
              f"to seeds {seeds[0]}-{seeds[-1]} ({epochs} epochs each; objective {objective})", flush=True)
        root = str(Path(storage).resolve()) if "://" not in storage else storage
        stage._train(plan, args, uri, experiment_id, parent.info.run_id,
                     f"{root}/{args.search}-confirm-more-{key.hexdigest()[:8]}", configs, missing, racing, metric,
                     objective)
    else:
        print(f"confirm: every run of seeds {seeds[0]}-{seeds[-1]} has finished; judging them again", flush=True)
    confirm = gate.Confirm(**_gate_settings(record))
    winner = gate.judge(racing, confirm, seeds=len(seeds))
    if winner is None:
        raise SystemExit(f"confirm: error: the paper's config did not finish all its seeds "
                         f"({stage.reference_line(racing)}); run the command again to finish them")
    for c in candidates:
        if c not in racing:
            c.verdict = f"not extended ({len(c.objective)} seeds); was: {c.verdict.split('was: ')[-1]}"
    noise = gate.noise_and_rank(candidates, record.get("rungs") or [epochs], window)
    extra = {k: v for k, v in record.items() if k not in ("objective", "winner", "rows")}
    extra.update(winner_config=configs.get(winner.label) or _config(client, runs, winner.label),
                 winner_run_id=stage._typical_run(uri, experiment_id, parent.info.run_id, winner),
                 seeds=sorted({s for c in candidates for s in c.objective}), noise=noise,
                 runs=sum(len(c.objective) for c in candidates), wall_s=record.get("wall_s", 0) + time.monotonic() - t0)
    new = gate.to_record(candidates, winner, objective, extra)
    text = gate.table(candidates, objective)
    stage._record(uri, parent.info.run_id, new, text, noise)
    print(f"confirm: {new['runs']} runs in all\n{text}\n" + stage._noise_line(noise) + "\n" + (
        f"confirm: {winner.label} beats the paper's config over seeds" if winner.label != REFERENCE else
        "confirm: no finalist beats the paper's config beyond seed noise")
        + f"; `cowtune promote --search {args.search}` promotes it", flush=True)
    return new


def _metric_and_window(record: dict[str, Any]) -> tuple[str, int]:
    """The tracked error and the epochs the objective averages (the stage records them; older records by name)."""
    if "metric" in record and "window" in record:
        return record["metric"], int(record["window"])
    m = re.fullmatch(r"(.+)_mean(\d+)", record["objective"])
    return (m.group(1), int(m.group(2))) if m else (record["objective"], 1)


def _gate_settings(record: dict[str, Any]) -> dict[str, Any]:
    """The stage's gate thresholds (alpha, max_std, max_rise) as the search file declared them."""
    fields = dict(re.findall(r"(alpha|max_std|max_rise)=([0-9.e-]+)", record.get("confirm", "")))
    return {k: float(v) for k, v in fields.items()}


def _candidate(client: MlflowClient, row: dict[str, Any], runs: list[Any], objective: str, metric: str,
               window: int, epochs: int) -> Candidate:
    """A config of the stage with its finished runs' objectives and curves, read back from MLflow."""
    from trainables.search import confirm as stage
    c = Candidate(row["label"], row["search_value"], window=window, verdict=row["verdict"])
    for r in runs:
        if (r.data.tags.get(stage.CANDIDATE_TAG) == c.label and objective in r.data.metrics
                and int(r.data.metrics.get(M.EPOCH, -1)) == epochs):
            seed = int(r.data.tags["cowtune.confirm_seed"])
            history = {h.step: h.value for h in client.get_metric_history(r.info.run_id, metric)}
            c.objective[seed] = r.data.metrics[objective]
            c.curves[seed] = [history[e] for e in sorted(history)]
    return c


def _chosen(candidates: list[Candidate], only: str | None) -> list[Candidate]:
    finalists = [c for c in candidates if c.label != REFERENCE and c.objective]
    if only is None:
        check(bool(finalists), "--search", "have a finalist with finished confirm runs", "none")
        return [min(finalists, key=lambda c: c.mean)]
    labels = [s.strip() for s in only.split(",") if s.strip()]
    known = {c.label for c in finalists}
    check(bool(labels) and set(labels) <= known, "--only", f"name finalists of the stage ({', '.join(sorted(known))})",
          only)
    return [c for c in finalists if c.label in labels]


def _config(client: MlflowClient, runs: list[Any], label: str) -> dict[str, Any]:
    """A candidate's config, from one of its confirm runs (the seed is set per run)."""
    from trainables.search import confirm as stage
    run = next(r for r in runs if r.data.tags.get(stage.CANDIDATE_TAG) == label)
    return yaml.safe_load(mlflow_runs.read_artifact(client, run, "config.yaml"))
