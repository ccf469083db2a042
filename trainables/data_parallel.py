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
* the gradients and the batch-norm running statistics are averaged over the workers every step, before the update
  (``GradientMean``, one all-reduce inside the step, so the whole step stays one CUDA graph as on one GPU): the
  students stay identical and so do the teachers. ``replica_spread`` (0 when in sync) checks it.

Nothing here imports Ray: ``trainables/search/trial.py`` launches the workers with Ray Train in ``cowtune final``;
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
from trainables.legacy_checkpoints import upgrade_optimizer_state
from trainables.step import Scores, StepRunner, evaluate
from trainables.trainer import build_runner, choose_convolutions, train_epoch

MASK_STREAM_STRIDE = 7919   # worker r draws its masks from stream seed + 7919 r (worker 0: the run's own)


@dataclass
class Replica:
    """What one worker holds: its data (every image, on its device), its student, teacher and step."""
    cfg: TrainConfig
    rank: int
    world: int
    data: TrainData
    runner: StepRunner              # its student, teacher and optimizer
    base_lr: float
    steps: int
    start: int                      # the first epoch to run (a checkpoint's epoch when resumed)


def build_replica(cfg: TrainConfig, rank: int, world: int, device: torch.device,
                  state: dict[str, Any] | None = None) -> Replica:
    """This worker's replica, from ``cfg.seed`` (every worker builds the same weights) or from ``state``: the
    one-GPU runner (``trainer.build_runner``: the whole step in one CUDA graph where ``train.fast.cuda_graph`` asks), whose
    step averages the gradients over the workers before each update (``GradientMean``)."""
    check_batch_split(cfg, world)
    if device.type == "cuda":
        torch.cuda.set_device(device)   # NCCL's collectives and the CUDA graphs on this worker's GPU
    choose_convolutions(cfg, device)
    data = prepare_data(cfg.data, cfg.labeled_seed, device, cfg.train.fast.compile)
    runner = build_runner(cfg, data.num_classes, device, grad_sync=GradientMean(world))
    base_lr, start = runner.optimizer.param_groups[0]["lr"], 0   # before a checkpoint's last LR replaces it
    if state is not None:
        runner.student.load_state_dict(state["student"]), runner.teacher.load_state_dict(state["teacher"])
        runner.optimizer.load_state_dict(upgrade_optimizer_state(state["optimizer"], state["student"], runner.student))
        start = state["epoch"]
    steps = cfg.train.steps_per_epoch or data.default_steps_per_epoch(cfg.train.batch_size)
    return Replica(cfg, rank, world, data, runner, base_lr, steps, start)


class GradientMean:
    """A worker's step hook (``StepRunner(grad_sync=...)``): after the backward pass, before the update, the
    student's gradients and batch-norm running statistics are averaged over the workers in one all-reduce of one
    flat buffer. Every worker then applies the whole batch's gradient and keeps the same statistics, so the
    students, and the teachers (their EMA), stay identical. Plain tensor operations and one collective: a captured
    step (``trainables.fast.step_graph``) captures them with the rest (NCCL collectives can be captured)."""

    def __init__(self, world: int):
        self.world = world

    @torch.no_grad()
    def __call__(self, student: nn.Module) -> None:
        tensors = [p.grad for p in student.parameters() if p.grad is not None]
        tensors += [b for b in student.buffers() if b.is_floating_point()]   # running means and variances
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat)
        flat.div_(self.world)
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(part.view(t.shape))


def run_epoch(rep: Replica, epoch: int) -> dict[str, float]:
    """One epoch on every worker (a collective: all call it), then the evaluation, sharded and summed."""
    cfg = rep.cfg
    metrics = train_epoch(cfg, rep.runner, rep.data, epoch, rep.steps, rep.base_lr,
                          stream=cfg.seed + MASK_STREAM_STRIDE * rep.rank, shard=(rep.rank, rep.world))
    metrics = _mean_over_workers(metrics)   # each worker's losses are its slice's: the whole batch's are their mean
    split = cfg.data.eval_split
    for name, model in (("teacher", rep.runner.teacher), ("student", rep.runner.student)):
        metrics.update(M.eval_metrics(split, name, _sharded_eval(model, rep.data.eval_batches(
            split, cfg.train.eval_batch_size, shard=(rep.rank, rep.world)), rep)))
    metrics["world_size"] = rep.world
    metrics["replica_spread"] = _replica_spread(rep)
    return metrics


def state_dict(rep: Replica, epoch: int) -> dict[str, Any]:
    """What resumes the run after ``epoch`` epochs (tensors and plain values only: it loads with weights_only)."""
    r = rep.runner
    return {"epoch": epoch, "student": r.student.state_dict(), "teacher": r.teacher.state_dict(),
            "optimizer": r.optimizer.state_dict(), "config": rep.cfg.to_dict()}


def _sharded_eval(model: nn.Module, shard: Any, rep: Replica) -> Scores:
    """This worker's evaluation batches (every world-th, the only ones its pipeline reads), summed over workers."""
    seen = [0]

    def counted(batches: Any) -> Any:
        for x, y in batches:
            seen[0] += y.shape[0]
            yield x, y
    s = evaluate(model, counted(shard), rep.runner.autocast, rep.runner.memory_format)
    n = float(seen[0])
    if n == 0:
        s = Scores(0.0, 0.0)
    top5 = s.error5 is not None   # the same on every worker with a shard: the model's classes
    total = torch.tensor([s.error * n, s.loss * n, (s.error5 or 0.0) * n, n, float(top5)], dtype=torch.float64,
                         device=_collective_device())
    dist.all_reduce(total)
    return Scores(float(total[0] / total[3]), float(total[1] / total[3]),
                  float(total[2] / total[3]) if total[4] > 0 else None)


def _mean_over_workers(metrics: dict[str, float]) -> dict[str, float]:
    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(values)
    return {k: float(v) / dist.get_world_size() for k, v in zip(keys, values.tolist())}


def _replica_spread(rep: Replica) -> float:
    """max - min over workers of the sum of the student's weights and the teacher's weights and statistics: 0.0
    while the workers stay identical."""
    r = rep.runner
    tensors = [*r.student.parameters(), *(t for t in r.teacher.state_dict().values() if t.is_floating_point())]
    sums = torch.stack([t.detach().double().sum() for t in tensors]).sum().reshape(1)   # no host sync
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
    rep = None
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
        if rep is not None:
            rep.runner.release_graphs()   # else destroying the group waits forever for the captured all-reduce
        dist.destroy_process_group()
