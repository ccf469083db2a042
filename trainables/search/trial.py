"""The Ray Tune function trainable: one trial = one ``trainer.fit`` run, reported every epoch.

``config`` is a full ``TrainConfig`` dict plus a ``"_cowtune"`` entry set by the driver (tracking URI, experiment and
parent run ids, mode, resources). Per epoch the trainable logs the metrics to the trial's MLflow child run (step =
epoch, skipping epochs already there), then calls ``ray.tune.report(metrics, checkpoint=...)`` with the trial folder
(``checkpoint.pt``, the MLflow run id); a retry or restore resumes from the latest, in the trial's own MLflow run.

Data-parallel ``cowtune final`` runs: one Tune trial launches a Ray Train TorchTrainer over N workers (GPUs).

Each worker runs ``trainables.data_parallel``: the same run as one GPU, its batch of ``train.batch_size`` split
over the workers (batch-norm statistics per worker, the mix partner rolled within each worker's slice, the teacher
identical everywhere). Rank 0 logs to the trial's MLflow run, writes the checkpoint and reports it; a restarted
run resumes from it on every worker. Evaluation is sharded over the workers and summed.

Learning curves of a run as a PNG (matplotlib, headless), for MLflow artifacts.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import torch
import yaml
from ray import tune

from trainables import metrics as M
from trainables.config import TrainConfig
from trainables.data import TrainData, prepare_data
from trainables.fast.compile_options import tune_kernels_by_default
from trainables.gallery import config_gallery
from trainables.search.mlflow_runs import TrialRun
from trainables.search.plan import GPU_FRACTION, trial_resources  # noqa: F401 - the trainable's resources
from trainables.trainer import fit, resolve_device
from trainables.validation import ConfigError, RunOutOfMemory, TrainingDiverged

LIVE_CURVE_S = 30.0   # seconds between a trial's own learning-curve drawings

META, TRAIN_CONFIG = "_cowtune", "_final"   # driver settings; final runs: {"config": ..., "dataset", "labels", ...}
REFUSED = "refused"   # in META: the ConfigError an earlier attempt raised (experiments.FinishChildRuns): not retried

_DATA: dict[str, TrainData] = {}   # per worker process: loaded once, shared by the trials it runs
DATA_LOADS = 0
_OUT_DIRS: list[Path] = []         # this worker's trial folders, removed when it starts its next trial


class HoldoutOnly:
    """A TrainData that refuses the test split: what every search trial trains with."""

    def __init__(self, data: TrainData):
        self._data = data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._data, name)

    def eval_batches(self, split: str, batch_size: int, shard: tuple[int, int] = (0, 1)):
        if split != "val":
            raise ConfigError(f"data.eval_split must be 'val' in a search (the test split is off limits), got {split!r}")
        return self._data.eval_batches(split, batch_size, shard)


def cached_data(cfg: TrainConfig, device: torch.device) -> TrainData:
    global DATA_LOADS
    key = json.dumps([cfg.to_dict()["data"], cfg.labeled_seed, str(device), cfg.train.fast.compile], sort_keys=True)
    if key not in _DATA:
        _DATA.clear()     # one dataset per worker at a time keeps memory bounded
        _DATA[key] = prepare_data(cfg.data, cfg.labeled_seed, device, cfg.train.fast.compile)
        DATA_LOADS += 1
    return _DATA[key]


def train_trial(config: dict[str, Any]) -> None:
    meta = config[META]
    if meta.get(REFUSED):   # it would recur: this attempt, Ray's retry, ends at once (and is the last)
        raise ConfigError(meta[REFUSED])
    search = meta["mode"] in ("search", "confirm")   # the confirm stage too: finalists re-run on the holdout
    tune_kernels_by_default(not search)   # a search's trial does not repay the tuning's longer first compile
    body = config[TRAIN_CONFIG]["config"] if TRAIN_CONFIG in config else {k: v for k, v in config.items() if k != META}
    cfg = TrainConfig.from_dict(body)
    if search and cfg.data.eval_split != "val":
        raise ConfigError(f"data.eval_split must be 'val' in a search, got {cfg.data.eval_split!r}")
    ctx = tune.get_context()
    trial_id, trial_name = ctx.get_trial_id(), ctx.get_trial_name()
    workers = config.get(TRAIN_CONFIG, {}).get("ddp_workers", 1)
    if workers > 1:   # ImageNet: data-parallel over the trial's GPUs with Ray Train; rank 0 reports and logs
        from ray.tune.integration.ray_train import TuneReportCallback
        fit_data_parallel(cfg, workers, meta.get("use_gpu", False), meta["storage"], f"{trial_name}-ddp",
                          callbacks=[TuneReportCallback()],
                          tracking={**meta, "trial_id": trial_id, "trial_name": trial_name, "workers": workers})
        return
    while _OUT_DIRS:   # folders of earlier trials of this (reused) worker, e.g. ones ASHA stopped mid-epoch
        shutil.rmtree(_OUT_DIRS.pop(), ignore_errors=True)
    out = Path(tempfile.mkdtemp(prefix=f"cowtune-{trial_id}-"))
    _OUT_DIRS.append(out)
    if checkpoint := tune.get_checkpoint():        # retry / restore: continue from the last epoch, same MLflow run
        with checkpoint.as_directory() as d:
            shutil.copytree(d, out, dirs_exist_ok=True)
    device = resolve_device(cfg.train.device)
    if device.type == "cuda" and 0 < meta.get("gpu", 0) < 1:   # packed trials cannot starve each other
        torch.cuda.set_per_process_memory_fraction(meta["gpu"], torch.cuda.current_device() if device.index is None else device.index)
    if device.type == "cpu" and cfg.train.threads is None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, threads=meta.get("cpus", 1)))
    loads_before = DATA_LOADS
    data = cached_data(cfg, device)
    data = HoldoutOnly(data) if search else data
    log = lambda s: print(f"[{trial_name}] {s}", flush=True)   # noqa: E731 - the driver's console, per trial
    run = TrialRun(meta["uri"], meta["experiment_id"], meta["parent_run_id"], trial_id, trial_name, out,
                   cfg.to_dict(), {"dataset": cfg.data.dataset, "n_labeled": str(cfg.data.n_labeled), "method": cfg.method,
                                   "model": cfg.model, "seed": str(cfg.seed), "mlflow.source.git.commit": meta.get(
                                       "git_sha", "unknown"), **{f"split.{k}": v for k, v in data.split_hashes.items()},
                                   **config.get(TRAIN_CONFIG, {}).get("tags", {})},
                   log)
    if run.earlier_failure:   # Ray's retry of a trial that diverged or ran out of memory would do so again
        raise RuntimeError(f"not retried, {run.earlier_failure}")
    run.set_tags({"worker.pid": os.getpid(), "worker.data_cache_hit": DATA_LOADS == loads_before,
                  "worker.node_id": ray.get_runtime_context().get_node_id()})
    if run.created:
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        run.log_artifact(out / "config.yaml")
        gallery = config_gallery(cfg, data.image_shape[1:], out / "masks.png")
        if gallery:
            run.log_artifact(gallery)
    last_curve = [float("-inf")]

    window = meta.get("mean_of_last", 1)   # the search's objective: its metric averaged over the last epochs

    def report(epoch: int, metrics: dict[str, float], ckpt_path: Path) -> None:
        # The run's own metrics.jsonl (a resumed trial's checkpoint folder carries it): the objective; a live curve at
        # most every LIVE_CURVE_S (one takes ~0.2 s of an H100 epoch's ~1.5 s; the driver draws the final one)
        curve_due = time.monotonic() - last_curve[0] >= LIVE_CURVE_S
        history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] \
            if window > 1 or curve_due else []
        if window > 1:
            metrics = {**metrics, M.mean_of_last(meta["metric"], window): M.window_mean(history, meta["metric"],
                                                                                      window)}
        run.log_epoch(epoch, metrics)
        if curve_due:
            last_curve[0] = time.monotonic()
            run.log_artifact(learning_curve_png(history, out / CURVE_FILE, trial_name))
        if epoch == cfg.train.epochs:   # before the last report: a scheduler may stop the trial right after it
            run.log_artifact(ckpt_path, "checkpoint")    # what `cowtune promote` registers
        tune.report({**metrics, "data_loads": DATA_LOADS}, checkpoint=tune.Checkpoint.from_directory(out))

    try:   # Ray keeps the trial's earlier checkpoints: no .prev copy
        fit(cfg, out, report=report, data=data, log=log, shared_gpu=0 < meta.get("gpu", 0) < 1, keep_previous=False)
    except (TrainingDiverged, RunOutOfMemory) as exc:   # the reason on the MLflow run; Tune marks the trial ERROR
        run.record_failure(exc)
        raise
    run.finish("FINISHED")
    shutil.rmtree(out, ignore_errors=True)


STATE = "state.pt"


def train_loop_per_worker(config: dict[str, Any]) -> None:
    from ray import train as ray_train   # here, as in fit_data_parallel: a search's driver never loads Ray Train
    from ray.train.torch import get_device

    from trainables.data_parallel import build_replica, run_epoch, state_dict
    cfg = TrainConfig.from_dict(config["train_config"])
    ctx = ray_train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = get_device()
    if device.type == "cpu" and cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    state = None
    if checkpoint := ray_train.get_checkpoint():
        with checkpoint.as_directory() as d:
            state = torch.load(Path(d) / STATE, map_location=device, weights_only=True)   # no code from the file
    rep = build_replica(cfg, rank, world, device, state)
    run = _trial_run(config.get("tracking"), cfg, rep.data) if rank == 0 else None
    try:
        for epoch in range(rep.start, cfg.train.epochs):
            metrics = run_epoch(rep, epoch)
            if run is not None:
                run.log_epoch(epoch + 1, metrics)
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    torch.save(state_dict(rep, epoch + 1), Path(d) / STATE)
                ray_train.report(metrics, checkpoint=ray_train.Checkpoint.from_directory(d) if rank == 0 else None)
    finally:
        rep.runner.release_graphs()   # Ray Train destroys the process group next: not while a graph holds NCCL
    if run is not None:
        run.finish("FINISHED")
        shutil.rmtree(run.out_dir, ignore_errors=True)


def _trial_run(info: dict[str, Any] | None, cfg: TrainConfig, data: Any) -> Any:
    """Rank 0 logs to the MLflow child run of the Tune trial that launched this data-parallel run."""
    if not info:
        return None
    from trainables.search.mlflow_runs import TrialRun
    out = Path(tempfile.mkdtemp(prefix="cowtune-ddp-"))
    run = TrialRun(info["uri"], info["experiment_id"], info["parent_run_id"], info["trial_id"], info["trial_name"], out,
                   cfg.to_dict(), {"dataset": cfg.data.dataset, "n_labeled": str(cfg.data.n_labeled), "method": cfg.method,
                                   "model": cfg.model, "seed": str(cfg.seed), "data_parallel.workers": str(info["workers"]),
                                   "mlflow.source.git.commit": info.get("git_sha", "unknown"),
                                   **{f"split.{k}": v for k, v in data.split_hashes.items()}})
    run.out_dir = out
    return run


def fit_data_parallel(cfg: TrainConfig, num_workers: int, use_gpu: bool, storage_path: str, name: str,
                      callbacks: list | None = None, tracking: dict[str, Any] | None = None) -> Any:
    """Run ``cfg`` on ``num_workers`` Ray Train workers (one GPU each when ``use_gpu``); returns the Result.

    Inside a Tune trial pass ``callbacks=[TuneReportCallback()]`` so rank 0's reports reach Tune, and
    ``tracking`` (tracking URI, experiment, parent run, trial id/name) so rank 0 logs to the trial's MLflow run.
    """
    from ray import train as ray_train
    from ray.train.torch import TorchTrainer
    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config={"train_config": cfg.to_dict(), "tracking": tracking},
        scaling_config=ray_train.ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                               resources_per_worker=None if use_gpu else {"CPU": 1}),
        run_config=ray_train.RunConfig(name=name, storage_path=storage_path, callbacks=callbacks or [],
                                       failure_config=ray_train.FailureConfig(max_failures=2)),
    )
    return trainer.fit()


CURVE_FILE = "learning_curve.png"


def learning_curve_png(history: list[dict[str, float]], path: Path, title: str) -> Path:
    """Every val/* and train/loss_* metric against the epoch, as a PNG (matplotlib, Agg)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_err, ax_loss) = plt.subplots(1, 2, figsize=(9, 3.5))
    epochs = [h["epoch"] for h in history]
    for key in sorted(history[-1]):
        ax = ax_err if key.startswith(("val/error", "test/error")) else ax_loss if "loss" in key else None
        if ax is not None:
            ax.plot(epochs, [h.get(key, float("nan")) for h in history], marker=".", label=key)
    for ax, label in ((ax_err, "error"), (ax_loss, "loss")):
        ax.set_xlabel("epoch"), ax.set_ylabel(label), ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
