"""``run_search(BASE, SPACE, SEARCH)``: Optuna proposes, ASHA stops, Ray Tune runs, MLflow records.

Everything that can be wrong with a search is checked before Ray starts (``prepare_search``). The same command again
restores a search whose driver died (``Tuner.restore``, the same MLflow parent run), or with a larger --trials grows
a finished one (``studies``); a round's end puts the best trial, a description and plots on the parent (``studies``).

Early stopping and TPE: ``studies.BudgetAwareOptunaSearch``.

Grace period rule: ``max(ceil(epochs * min_rung), ceil(3 * H))`` epochs (``SearchSettings.min_rung``, 1/4 unless the
search file says), where H = 1 / ((1 - alpha_max) * steps_per_epoch)
is the EMA teacher's time constant in epochs for the largest alpha the space can draw: after 3 H the random
initialisation's share of the teacher, alpha^steps, is below e^-3 = 5%; before, it would be judged on its start.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import optuna
import ray
from ray import tune

from trainables import metrics as M
from trainables.config import TrainConfig
from trainables.data import warm_decode_cache
from trainables.search import compile_ahead
from trainables.search import experiments, mlflow_runs, progress, studies
from trainables.search.confirm import run_confirm
from trainables.search.experiments import (FinishChildRuns, check_resumable, check_tracking_server, lock_job,
                                          open_experiment)
from trainables.search.gate import Confirm
from trainables.search.plan import HOLDOUT, SearchSettings, check_data_fits, check_files, parse_args, prepare_search
from trainables.search.trial import META, train_trial, trial_resources
from trainables.validation import ConfigError, disk_full

__all__ = ["Confirm", "HOLDOUT", "SearchSettings", "run_search"]


_trial_dirname = lambda trial: f"{trial.trainable_name}_{trial.trial_id}"   # noqa: E731 - not the config: long paths


def run_search(base: Any, space: dict[str, Any], settings: SearchSettings, argv: list[str] | None = None) -> Any:
    args = parse_args(settings, argv)
    try:
        plan = prepare_search(base, space, settings, args)  # every check before Ray starts, then the files
        check_files(plan, args)
        check_data_fits(plan, args)   # the holdout and labels against the data: not every trial failing on it
        check_tracking_server()
        study_db = studies.open_storage(url) if (url := studies.storage_url(args.optuna_storage)) else None
        lock_job(plan.name, plan.storage, "search")   # one driver at a time for a search
        study_db = study_db or studies.default_storage(plan.storage, plan.name)
        check_resumable(plan.name, plan.storage, plan.tags, plan.settings, growable=study_db is not None)
        round_ = studies.next_round(plan.name, plan.storage, plan.num_samples, study_db)
    except ConfigError as exc:
        print(f"{settings.name}: error: {exc}", file=sys.stderr)   # one clear line, exit status 2 as `cowtune`'s
        raise SystemExit(2) from None
    base = TrainConfig.from_dict(plan.base)
    if not args.no_compile_ahead:   # the step's first compilation, the longest wait, starts now
        compile_ahead.start(base)
    if (warming := warm_decode_cache(base.data)) is not None:   # while compile-ahead starts; trials read its cache
        warming.join()
        if warming.error is not None:   # a bad image file: named now, not as every trial failing
            print(f"{settings.name}: error: {warming.error}", file=sys.stderr)
            raise SystemExit(2)
    uri, experiment_id, exp_path, parent_id, restoring = open_experiment(plan.name, plan.storage, plan.tags,
                                                                         plan.settings, list(round_.paths))
    try:
        return _run(plan, space, settings, args, uri, experiment_id, exp_path, parent_id, restoring, round_, study_db)
    except SystemExit:   # every trial failed: said in one line, the parent run already ended as FAILED
        raise
    except BaseException as exc:   # Ctrl-C, a Ray error: the parent run says so (the same command resumes, re-opens it)
        if mlflow_runs.is_outage(exc):   # MLflow gone at the end: Ray holds the results, the trials' nodes the records
            raise SystemExit(f"{plan.name}: error: MLflow at {uri} does not answer; results are in {exp_path}, records on"
                             " the trials' nodes: when it answers, run `cowtune upload` there (no summary recorded)") from None
        mlflow_runs.finish_run(uri, parent_id, "FAILED")
        if "://" not in plan.storage and (full := disk_full(plan.storage)) is not None:   # Ray's errors said it
            raise SystemExit(f"{plan.name}: error: --storage {plan.storage} filled up ({full}): free space there and "
                             "run the same command to resume") from None
        raise


def _run(plan: Any, space: dict[str, Any], settings: SearchSettings, args: Any, uri: str, experiment_id: str,
         exp_path: str, parent_id: str, restoring: bool, round_: studies.Round, study_db: Any) -> Any:
    resources = trial_resources(plan.base["model"], args.cpus_per_trial, ray.cluster_resources().get("GPU", 0),
                                args.gpu_share)
    meta = {"uri": uri, "experiment_id": experiment_id, "parent_run_id": parent_id, "mode": "search",
            "git_sha": mlflow_runs.git_sha(), "cpus": args.cpus_per_trial, "gpu": resources.get("gpu", 0),
            "mean_of_last": settings.mean_of_last, "metric": settings.metric}
    objective = settings.objective
    trainable = tune.with_resources(train_trial, resources)
    print(f"search {plan.name}: {plan.num_samples} trials x {plan.epochs} epochs, {resources} per trial, grace "
          f"{plan.grace} epochs; MLflow {uri} (parent run {parent_id}); Ray results {exp_path}"
          + studies.describe(round_, study_db) + (" [resuming]" if restoring else ""), flush=True)
    if restoring:
        tuner = tune.Tuner.restore(exp_path, trainable=trainable, resume_unfinished=True, resume_errored=True)
    else:
        searcher = studies.BudgetAwareOptunaSearch(space, plan.epochs, metric=objective, mode=settings.mode,
                                           points_to_evaluate=None if round_.index else plan.points,
                                           sampler=optuna.samplers.TPESampler(seed=plan.seed + round_.index),
                                           study_name=plan.name, storage=study_db)
        scheduler = tune.schedulers.ASHAScheduler(time_attr=M.EPOCH, metric=objective, mode=settings.mode,
                                                  max_t=plan.epochs, grace_period=plan.grace,
                                                  reduction_factor=settings.reduction_factor,
                                                  stop_last_trials=False)
        tuner = tune.Tuner(
            trainable, param_space={**plan.base, META: meta},
            tune_config=tune.TuneConfig(search_alg=searcher, scheduler=scheduler, num_samples=round_.num_samples,
                                        max_concurrent_trials=args.concurrency, reuse_actors=True,
                                        trial_dirname_creator=_trial_dirname),
            run_config=tune.RunConfig(name=Path(exp_path).name, storage_path=plan.storage, verbose=progress.verbose(args),
                                      failure_config=tune.FailureConfig(max_failures=settings.max_failures),
                                      checkpoint_config=tune.CheckpointConfig(num_to_keep=2),
                                      callbacks=[FinishChildRuns(uri, experiment_id, parent_id, plan.epochs),
                                                 *progress.callbacks(args, settings, plan, space)]))
    experiments.stop_cleanly()   # after ray.init: SIGTERM as Ctrl-C, not Ray's stack dump
    results = tuner.fit()
    _stop_if_stopped(plan.name, uri, parent_id)
    best = progress.best_result(results, objective, settings.mode)   # None: every trial failed, said below
    failed = sum(1 for r in results if r.error)
    studies.end_orphaned_trials(study := studies.load(study_db, plan.name))
    studies.record(uri, parent_id, study, space, plan, objective, round_.index)
    if best is not None and best.metrics and best.metrics.get(objective) is not None:
        print(f"best trial {best.metrics.get('trial_id')}: {objective} = {best.metrics.get(objective):.4f} "
              f"at epoch {best.metrics.get(M.EPOCH)} (one seed)")
    if plan.confirm is not None and failed < len(results):   # before promotion: the finalists on fresh seeds
        run_confirm(plan, space, settings, args, uri, experiment_id, parent_id, exp_path)
        _stop_if_stopped(plan.name, uri, parent_id)
    mlflow_runs.finish_run(uri, parent_id, "FAILED" if failed else "FINISHED",
                        {"cowtune.best_trial": best.metrics.get("trial_id", "") if best else "",
                         studies.ROUNDS_TAG: round_.index + 1, "cowtune.trials": plan.num_samples})
    if results and failed == len(results):   # nothing to compare or promote: one line and a failing exit status
        first = next(str(r.error).strip().splitlines()[-1] for r in results if r.error)
        print(f"{plan.name}: error: every trial failed ({failed} of {len(results)}); the first: {first[:300]}",
              file=sys.stderr, flush=True)
        raise SystemExit(1)
    print(f"done: {len(results)} trials ({failed} failed). Compare them with "
          + studies.ui_link(uri, experiment_id)
          + f"; promote with `cowtune promote --search {plan.name}`", flush=True)
    return results


def _stop_if_stopped(name: str, uri: str, parent_id: str) -> None:
    """Stopped by a signal (``stop_cleanly``): parent KILLED, Ray shut down (workers' last lines first), one line."""
    if (by := experiments.stopped_by()) is not None:
        mlflow_runs.finish_run(uri, parent_id, "KILLED")
        ray.shutdown()
        print(f"{name}: stopped by {by}; Ray saved its state: run the same command to resume", file=sys.stderr)
        raise SystemExit(143 if by == "SIGTERM" else 130)
