"""Data-parallel training of one config over several workers (GPUs) with Ray Train's TorchTrainer.

Used for ImageNet in ``cowtune final``: one trial = one TorchTrainer whose workers each hold a
replica of the student (DDP: gradients all-reduced every step) and of the EMA teacher (updated
from identical student weights, so the replicas stay equal). ``trainer.fit`` is single-process, so
this module wraps the student in DDP and runs ``trainer.train_epoch`` (the same epoch of steps, random
streams, learning-rate schedule and teacher EMA as ``fit``) with sharded evaluation and rank-0 checkpoints.

Per step each worker draws its own labeled and unlabeled batches (the data stream is seeded with
the worker rank), so the global batch is ``world_size x train.batch_size`` and the learning rate is
scaled to it (``lr_per_256``). Evaluation is sharded over workers and summed with all-reduce.
Rank 0 writes the checkpoint and reports it; a restarted run resumes from it.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ray import train as ray_train
from ray.train.torch import TorchTrainer, get_device, prepare_model

from trainables import metrics as M
from trainables.config import TrainConfig
from trainables.data import prepare_data
from trainables.fast.fast_conv import apply_conv_kernels
from trainables.legacy_checkpoints import upgrade_optimizer_state
from trainables.models import create_model
from trainables.optim import make_optimizer
from trainables.ssl.ema import make_teacher
from trainables.step import StepRunner, evaluate
from trainables.trainer import train_epoch

STATE = "state.pt"


def _sharded_eval(model: torch.nn.Module, batches: Any, runner: StepRunner, rank: int, world: int) -> tuple[float, float]:
    shard = [b for i, b in enumerate(batches) if i % world == rank]
    err, loss = evaluate(model, shard, runner.autocast, runner.memory_format) if shard else (0.0, 0.0)
    n = float(sum(y.shape[0] for _, y in shard))
    total = torch.tensor([err * n, loss * n, n], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total[0] / total[2]), float(total[1] / total[2])


def train_loop_per_worker(config: dict[str, Any]) -> None:
    cfg = TrainConfig.from_dict(config["train_config"])
    ctx = ray_train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = get_device()
    if device.type == "cpu" and cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    data = prepare_data(cfg.data, cfg.labeled_seed, device, cfg.train.compile)
    torch.manual_seed(cfg.seed)
    student = create_model(cfg.model, data.num_classes).to(device)
    apply_conv_kernels(student, cfg.train.conv_kernels, "model", device)   # DDP steps: graphs per model pass
    teacher = make_teacher(student)
    global_batch = cfg.train.batch_size * world
    optimizer = make_optimizer(student, cfg.optim, global_batch)
    base_lr, start = optimizer.param_groups[0]["lr"], 0   # before a checkpoint's last scheduled LR replaces it
    checkpoint = ray_train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(Path(d) / STATE, map_location=device, weights_only=True)   # no code from the file
        student.load_state_dict(state["student"]), teacher.load_state_dict(state["teacher"])
        optimizer.load_state_dict(upgrade_optimizer_state(state["optimizer"], state["student"], student))
        start = state["epoch"]
    replica = prepare_model(student, move_to_device=False)      # DistributedDataParallel (gloo on CPU, nccl on GPU)
    bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and device.type == "cuda")
    runner = StepRunner(cfg, replica, teacher, optimizer, device, bf16)
    steps = cfg.train.steps_per_epoch or data.default_steps_per_epoch(global_batch)
    split = cfg.data.eval_split
    run = _trial_run(config.get("tracking"), cfg, data) if rank == 0 else None
    for epoch in range(start, cfg.train.epochs):
        metrics = train_epoch(cfg, runner, data, epoch, steps, base_lr, stream=cfg.seed + 7919 * rank)
        for name, model in (("teacher", teacher), ("student", student)):
            err, loss = _sharded_eval(model, data.eval_batches(split, cfg.train.eval_batch_size), runner, rank, world)
            metrics[M.eval_key(split, "error", name)], metrics[M.eval_key(split, "loss", name)] = err, loss
        metrics["world_size"] = world
        sums = torch.tensor([sum(float(p.detach().double().sum()) for p in student.parameters())], dtype=torch.float64)
        gathered = [torch.zeros_like(sums) for _ in range(world)]
        dist.all_gather(gathered, sums)
        metrics["replica_spread"] = float(torch.cat(gathered).max() - torch.cat(gathered).min())   # 0: replicas in sync
        if run is not None:
            run.log_epoch(epoch + 1, metrics)
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                torch.save({"epoch": epoch + 1, "student": student.state_dict(), "teacher": teacher.state_dict(),
                            "optimizer": optimizer.state_dict(), "config": cfg.to_dict()}, Path(d) / STATE)
            ray_train.report(metrics, checkpoint=ray_train.Checkpoint.from_directory(d) if rank == 0 else None)
    if run is not None:
        run.finish("FINISHED")
        shutil.rmtree(run.out_dir, ignore_errors=True)


def _trial_run(info: dict[str, Any] | None, cfg: TrainConfig, data: Any) -> Any:
    """Rank 0 logs to the MLflow child run of the Tune trial that launched this data-parallel run."""
    if not info:
        return None
    from trainables.search import tracking
    out = Path(tempfile.mkdtemp(prefix="cowtune-ddp-"))
    run = tracking.TrialRun(info["uri"], info["experiment_id"], info["parent_run_id"], info["trial_id"],
                             info["trial_name"], out, cfg.to_dict(),
                             {"dataset": cfg.data.dataset, "n_labeled": str(cfg.data.n_labeled), "method": cfg.method,
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

