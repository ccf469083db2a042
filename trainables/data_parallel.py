"""One config trained data-parallel over torch.distributed workers (one GPU each, or CPU processes with gloo).

The run is one process's run, split: each step's ``train.batch_size`` labeled and unlabeled images are the ones a
single process would draw, and worker ``rank`` of ``world`` trains on its ``train.batch_size / world`` of them
(``trainer.train_epoch(shard=...)``). So, against one GPU:

* the learning rate is the same (set from ``train.batch_size``, the global batch), and so is the schedule;
* batch-norm statistics are per worker, as in the authors' ``pmap`` code (no cross-device reduction): with
  ``train.bn_batch`` unset, N workers normalise like ``train.bn_batch = train.batch_size / N`` on one GPU; with it
  set (the paper presets' 32), in groups of ``bn_batch`` inside each worker's slice, exactly as on one GPU;
* the mix partner is rolled within each worker's slice (the authors' per-device roll), and each worker draws its
  own masks (one random stream per worker);
* DDP averages the gradients every step, so the students stay identical and so do the teachers (the EMA of
  identical weights; DDP broadcasts rank 0's batch-norm buffers). ``replica_spread`` (0 when in sync) checks it.

Nothing here imports Ray: ``trainables/search/ddp.py`` launches the workers with Ray Train in ``cowtune final``;
``launch_local`` starts them as local processes (``benchmarks/data_parallel_epoch.py`` and the tests).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainables import metrics as M
from trainables.config import TrainConfig, check_batch_split
from trainables.data import prepare_data
from trainables.data.batches import TrainData
from trainables.fast.fast_conv import apply_conv_kernels
from trainables.legacy_checkpoints import upgrade_optimizer_state
from trainables.models import create_model
from trainables.optim import make_optimizer
from trainables.ssl.ema import make_teacher
from trainables.step import StepRunner, evaluate
from trainables.trainer import train_epoch

MASK_STREAM_STRIDE = 7919   # worker r draws its masks from stream seed + 7919 r (worker 0: the run's own)


@dataclass
class Replica:
    """What one worker holds: its data (every image, on its device), its student (wrapped in DDP) and teacher."""
    cfg: TrainConfig
    rank: int
    world: int
    data: TrainData
    student: nn.Module              # the plain module (checkpoints, the spread check); ``runner`` holds the DDP wrap
    teacher: nn.Module
    optimizer: torch.optim.Optimizer
    runner: StepRunner
    base_lr: float
    steps: int
    start: int                      # the first epoch to run (a checkpoint's epoch when resumed)


def build_replica(cfg: TrainConfig, rank: int, world: int, device: torch.device,
                  state: dict[str, Any] | None = None) -> Replica:
    """This worker's replica, from ``cfg.seed`` (every worker builds the same weights) or from ``state``."""
    check_batch_split(cfg, world)
    if device.type == "cuda":
        torch.cuda.set_device(device)   # NCCL's collectives and the CUDA graphs on this worker's GPU
    data = prepare_data(cfg.data, cfg.labeled_seed, device, cfg.train.compile)
    torch.manual_seed(cfg.seed)
    student = create_model(cfg.model, data.num_classes).to(device)
    apply_conv_kernels(student, cfg.train.conv_kernels, "model", device)   # DDP steps: graphs per model pass
    if cfg.train.channels_last and device.type == "cuda":
        student = student.to(memory_format=torch.channels_last)   # as one GPU (trainer.build_runner)
    teacher = make_teacher(student)
    optimizer = make_optimizer(student, cfg.optim, cfg.train.batch_size)
    base_lr, start = optimizer.param_groups[0]["lr"], 0   # before a checkpoint's last scheduled LR replaces it
    if state is not None:
        student.load_state_dict(state["student"]), teacher.load_state_dict(state["teacher"])
        optimizer.load_state_dict(upgrade_optimizer_state(state["optimizer"], state["student"], student))
        start = state["epoch"]
    wrapped = nn.parallel.DistributedDataParallel(student, device_ids=[device.index] if device.type == "cuda" else None)
    bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and device.type == "cuda")
    runner = StepRunner(cfg, wrapped, teacher, optimizer, device, bf16)
    steps = cfg.train.steps_per_epoch or data.default_steps_per_epoch(cfg.train.batch_size)
    return Replica(cfg, rank, world, data, student, teacher, optimizer, runner, base_lr, steps, start)


def run_epoch(rep: Replica, epoch: int) -> dict[str, float]:
    """One epoch on every worker (a collective: all call it), then the evaluation, sharded and summed."""
    cfg = rep.cfg
    metrics = train_epoch(cfg, rep.runner, rep.data, epoch, rep.steps, rep.base_lr,
                          stream=cfg.seed + MASK_STREAM_STRIDE * rep.rank, shard=(rep.rank, rep.world))
    metrics = _mean_over_workers(metrics)   # each worker's losses are its slice's: the whole batch's are their mean
    split = cfg.data.eval_split
    for name, model in (("teacher", rep.teacher), ("student", rep.student)):
        err, loss = _sharded_eval(model, rep.data.eval_batches(split, cfg.train.eval_batch_size), rep)
        metrics[M.eval_key(split, "error", name)], metrics[M.eval_key(split, "loss", name)] = err, loss
    metrics["world_size"] = rep.world
    metrics["replica_spread"] = _replica_spread(rep.student)
    return metrics


def state_dict(rep: Replica, epoch: int) -> dict[str, Any]:
    """What resumes the run after ``epoch`` epochs (tensors and plain values only: it loads with weights_only)."""
    return {"epoch": epoch, "student": rep.student.state_dict(), "teacher": rep.teacher.state_dict(),
            "optimizer": rep.optimizer.state_dict(), "config": rep.cfg.to_dict()}


def _sharded_eval(model: nn.Module, batches: Any, rep: Replica) -> tuple[float, float]:
    shard = [b for i, b in enumerate(batches) if i % rep.world == rep.rank]
    err, loss = evaluate(model, shard, rep.runner.autocast, rep.runner.memory_format) if shard else (0.0, 0.0)
    n = float(sum(y.shape[0] for _, y in shard))
    total = torch.tensor([err * n, loss * n, n], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(total)
    return float(total[0] / total[2]), float(total[1] / total[2])


def _mean_over_workers(metrics: dict[str, float]) -> dict[str, float]:
    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(values)
    return {k: float(v) / dist.get_world_size() for k, v in zip(keys, values.tolist())}


def _replica_spread(student: nn.Module) -> float:
    """max - min over workers of the sum of the student's weights: 0.0 while DDP keeps them identical."""
    sums = torch.stack([p.detach().double().sum() for p in student.parameters()]).sum().reshape(1)   # no host sync
    sums = sums.to(_collective_device())
    gathered = [torch.zeros_like(sums) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, sums)
    return float(torch.cat(gathered).max() - torch.cat(gathered).min())


def _collective_device() -> torch.device:
    """NCCL reduces CUDA tensors only; gloo CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def launch_local(cfg: TrainConfig, world: int, out: Path, epochs: int | None = None,
                 resume: bool = False, save_every: int = 1) -> list[dict[str, float]]:
    """Train ``cfg`` on ``world`` local processes, without Ray: one GPU each where CUDA has that many (NCCL), else
    CPU processes (gloo). Rank 0 appends each epoch's metrics (with ``epoch_s``, its wall time) to
    ``out/metrics.jsonl`` and writes ``out/state.pt`` after every ``save_every``-th epoch and the last one (a 27M
    model's state is ~320 MB); ``resume`` continues from ``out/state.pt``.
    Runs the epochs up to ``epochs`` (default ``train.epochs``) and returns every line of ``out/metrics.jsonl``."""
    check_batch_split(cfg, world)
    out.mkdir(parents=True, exist_ok=True)
    rendezvous = out / "rendezvous"
    rendezvous.unlink(missing_ok=True)
    torch.multiprocessing.spawn(_local_worker, args=(world, cfg.to_dict(), str(out), epochs, resume, save_every),
                                nprocs=world)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _local_worker(rank: int, world: int, config: dict[str, Any], out: str, epochs: int | None, resume: bool,
                  save_every: int) -> None:
    cfg, folder = TrainConfig.from_dict(config), Path(out)
    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= world and cfg.train.device != "cpu"
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if not gpu:
        torch.set_num_threads(cfg.train.threads or max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"file://{folder / 'rendezvous'}",
                            rank=rank, world_size=world)
    try:
        state = torch.load(folder / "state.pt", map_location=device, weights_only=True) if resume else None
        rep = build_replica(cfg, rank, world, device, state)
        end = epochs or cfg.train.epochs
        for epoch in range(rep.start, end):
            t0 = time.monotonic()
            metrics = run_epoch(rep, epoch)
            metrics["epoch_s"] = time.monotonic() - t0
            if rank == 0:
                if (epoch + 1) % save_every == 0 or epoch + 1 == end:
                    torch.save(state_dict(rep, epoch + 1), folder / "state.pt")
                with open(folder / "metrics.jsonl", "a") as f:
                    f.write(json.dumps({k: float(v) for k, v in metrics.items()}) + "\n")
            dist.barrier()
    finally:
        dist.destroy_process_group()
