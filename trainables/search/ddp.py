"""Data-parallel ``cowtune final`` runs: one Tune trial launches a Ray Train TorchTrainer over N workers (GPUs).

Each worker runs ``trainables.data_parallel``: the same run as one GPU, its batch of ``train.batch_size`` split
over the workers (batch-norm statistics per worker, the mix partner rolled within each worker's slice, the teacher
identical everywhere). Rank 0 logs to the trial's MLflow run, writes the checkpoint and reports it; a restarted
run resumes from it on every worker. Evaluation is sharded over the workers and summed.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from ray import train as ray_train
from ray.train.torch import TorchTrainer, get_device

from trainables.config import TrainConfig
from trainables.data_parallel import build_replica, run_epoch, state_dict

STATE = "state.pt"


def train_loop_per_worker(config: dict[str, Any]) -> None:
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
    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config={"train_config": cfg.to_dict(), "tracking": tracking},
        scaling_config=ray_train.ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                               resources_per_worker=None if use_gpu else {"CPU": 1}),
        run_config=ray_train.RunConfig(name=name, storage_path=storage_path, callbacks=callbacks or [],
                                       failure_config=ray_train.FailureConfig(max_failures=2)),
    )
    return trainer.fit()

