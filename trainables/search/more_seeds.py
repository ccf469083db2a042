"""``cowtune confirm``: more fresh seeds for a search's confirm stage, judged again over every seed.

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
from trainables.search import confirm as stage
from trainables.search import gate, mlflow_runs
from trainables.search.gate import REFERENCE, Candidate
from trainables.validation import ConfigError, check


def run(args: argparse.Namespace) -> dict[str, Any]:
    from trainables.search.experiments import init_ray
    from trainables.search.experiments import check_tracking_server, lock_job
    from trainables.search.promote import confirmed, latest_parent

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
    run = next(r for r in runs if r.data.tags.get(stage.CANDIDATE_TAG) == label)
    return yaml.safe_load(mlflow_runs.read_artifact(client, run, "config.yaml"))
