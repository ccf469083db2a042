"""Runs ``cowtune final`` on Ray: a grid of full configs (no search) logged under one MLflow parent run."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import ray
import yaml
from ray import tune

from trainables.config import TrainConfig, check_batch_split
from trainables.presets import yaml_problem
from trainables.search import experiments, mlflow_runs, progress
from trainables.search.confirm import ConfirmProgress
from trainables.search.experiments import (FinishChildRuns, check_resumable, check_tracking_server, lock_job,
                                          open_experiment)
from trainables.search.final import error_metric, final_configs, final_settings, provenance, save_table
from trainables.search.trial import META, TRAIN_CONFIG, train_trial, trial_resources
from trainables.validation import ConfigError, check


def run_final(config_path: str, datasets: dict[str, str], labels: list[int] | None, seeds: int, supervised: bool,
              overrides: list[str], name: str, storage: str, out_dir: str, cpus_per_trial: int = 1,
              concurrency: int | None = None, ddp_workers: int | None = None,
              check_data: bool = True, ray_output: bool = False) -> tuple[list[dict[str, Any]], str, int]:
    try:
        promoted = yaml.safe_load(Path(config_path).read_text())
    except yaml.YAMLError as exc:   # one line naming the file, before anything starts
        raise ConfigError(f"--config {config_path} is not valid YAML: {yaml_problem(exc)}") from None
    method = TrainConfig.from_dict(promoted).method
    runs = final_configs(promoted, datasets, labels, seeds, supervised, overrides, check_data)   # fails before Ray
    notes = provenance(promoted, overrides) if "imagenet" in datasets else ""   # where each ImageNet field came from
    if ddp_workers:   # the batch split too (ImageNet's default, every GPU, once Ray has counted them)
        check(ddp_workers >= 1, "--ddp-workers", "be >= 1", ddp_workers)
        for r in runs:
            check_batch_split(TrainConfig.from_dict(r["config"]), ddp_workers)
    storage = storage if "://" in storage else str(Path(storage).resolve())
    settings = final_settings(promoted, datasets, labels, seeds, supervised, overrides)
    fingerprint = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    tags = {"cowtune.search": name, "cowtune.final": config_path, "method": method, "cowtune.fingerprint": fingerprint}
    check_tracking_server()
    lock_job(name, storage, "final job")
    check_resumable(name, storage, tags, settings)   # the same name again: the same job, or refused before Ray
    uri, experiment_id, exp_path, parent_id, restoring = open_experiment(name, storage, tags, settings)
    gpus = ray.cluster_resources().get("GPU", 0)
    for r in runs:   # ImageNet: data-parallel over every GPU (CPU: 2 workers) unless told; small images: 1 unless told
        r["ddp_workers"] = ddp_workers or (max(2, int(gpus)) if r["dataset"] == "imagenet" else 1)
        if not ddp_workers:   # told: checked above, before Ray
            check_batch_split(TrainConfig.from_dict(r["config"]), r["ddp_workers"])
    meta = {"uri": uri, "experiment_id": experiment_id, "parent_run_id": parent_id, "mode": "final",
            "git_sha": mlflow_runs.git_sha(), "cpus": cpus_per_trial, "gpu": 0, "use_gpu": gpus > 0, "storage": storage}

    def resources(spec: dict[str, Any]) -> dict[str, float]:
        if spec[TRAIN_CONFIG]["ddp_workers"] > 1:
            return {"cpu": 0, "memory": 2**20}   # a token bundle: the Ray Train workers it launches hold CPUs/GPUs
        return trial_resources(spec[TRAIN_CONFIG]["config"]["model"], cpus_per_trial, gpus)

    trainable = tune.with_resources(train_trial, resources)
    verbose = progress.verbose(SimpleNamespace(ray_output=ray_output))   # Ray Tune's output, or one line a run
    shown = [] if ray_output else [ConfirmProgress(name, error_metric(runs[0]["config"]), "min", 0, [], stage="final")]
    print(f"final {name}: {len(runs)} runs ({method}{' + supervised' if supervised else ''} x {seeds} seeds); "
          f"MLflow {uri} (parent run {parent_id})" + (" [resuming]" if restoring else "") + (f"\n{notes}" if notes else ""),
          flush=True)
    if restoring:
        tuner = tune.Tuner.restore(exp_path, trainable=trainable, resume_unfinished=True, resume_errored=True)
    else:
        tuner = tune.Tuner(trainable, param_space={TRAIN_CONFIG: tune.grid_search(runs), META: meta},
                           tune_config=tune.TuneConfig(reuse_actors=True, max_concurrent_trials=concurrency),
                           run_config=tune.RunConfig(name=name, storage_path=storage, verbose=verbose,
                                                     failure_config=tune.FailureConfig(max_failures=2),
                                                     checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
                                                     callbacks=[FinishChildRuns(uri, experiment_id, parent_id, 0),
                                                                *shown]))
    experiments.stop_cleanly()   # after ray.init: SIGTERM as Ctrl-C, not Ray's stack dump
    try:
        results = tuner.fit()
    except BaseException:   # a second Ctrl-C, a Ray error: the parent run says so (the same command resumes it)
        mlflow_runs.finish_run(uri, parent_id, "FAILED")
        raise
    if (by := experiments.stopped_by()) is not None:   # Tune stopped the runs cleanly and saved its state
        mlflow_runs.finish_run(uri, parent_id, "KILLED")
        ray.shutdown()
        print(f"{name}: stopped by {by}; Ray saved its state: run the same command to resume", file=sys.stderr)
        raise SystemExit(143 if by == "SIGTERM" else 130)
    records, failed = [], []
    for r in results:
        spec = r.config[TRAIN_CONFIG]
        key = error_metric(spec["config"])
        err = (r.metrics or {}).get(key)
        run = {k: spec[k] for k in ("dataset", "labels", "method", "seed")}
        if r.error or err is None:
            why = str(r.error).strip().splitlines()[-1] if r.error else f"no {key} reported"
            failed.append(f"  {run['dataset']} labels {run['labels']} {run['method']} seed {run['seed']}: {why[:300]}")
            continue
        err5 = (r.metrics or {}).get(key.replace("/error_", "/error5_"))   # top-5: more than 10 classes
        records.append(run | {"error": err, "split": spec["config"]["data"]["eval_split"]}
                       | ({"error5": err5} if err5 is not None else {}))
    table = ""
    if records:
        path, table = save_table(Path(out_dir), records, method, notes)
        for artifact in (path, path.with_name("final_results.json")):
            mlflow_runs.log_run_artifact(uri, parent_id, artifact)
        print(table + f"\nsaved {path}", flush=True)
    mlflow_runs.finish_run(uri, parent_id, "FAILED" if failed else "FINISHED")
    print(f"{len(records)}/{len(results)} runs finished" + (f"; {len(failed)} failed:\n" + "\n".join(failed)
                                                             if failed else ""), flush=True)
    return records, table, len(failed)
