"""How many trials to pack on one GPU: k trials at once under Ray Tune, each asking 1/k of the GPU.

Each trial is the real trainer (``fit``) on GPU-resident data, capped to its share of GPU memory
with ``torch.cuda.set_per_process_memory_fraction``, as search trials are. Steps/s per trial is
read from the epochs that ran while all k trials were training (Ray starts them seconds apart,
and the first epoch includes compilation). Aggregate steps/s is the sum over the k trials ("with
eval": from the wall time between epoch reports, evaluation and checkpoints included); the
slowdown is the single-trial rate over the mean per-trial rate.
"""
from __future__ import annotations

import time
from typing import Any

import torch


def _trial(config: dict[str, Any]) -> None:
    import tempfile

    from ray import tune

    from trainables.config import TrainConfig
    from trainables.data import prepare_data
    from trainables.trainer import fit, resolve_device

    cfg = TrainConfig.from_dict(config["train_config"])
    device = resolve_device(cfg.train.device)
    if device.type == "cuda" and config["fraction"] < 1:
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_per_process_memory_fraction(config["fraction"], index)
    data = prepare_data(cfg.data, cfg.labeled_seed, device)

    def report(epoch, metrics, path):
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        tune.report({**metrics, "peak_mem_gib": peak, "wall_time": time.time()})

    with tempfile.TemporaryDirectory() as out:
        fit(cfg, out, report=report, data=data, log=lambda s: None, shared_gpu=config["fraction"] < 1)


def measure_packing(train_config: dict[str, Any], ks: list[int], gpus: float) -> list[dict[str, float]]:
    """Run k = each of ``ks`` identical trials at once; return one row per k."""
    import ray
    from ray import tune

    if not ray.is_initialized():
        # address="local": a new local instance, never a cluster someone else started on this machine
        ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
    rows = []
    for k in ks:
        fraction = 1.0 / k
        resources = {"cpu": 1, "gpu": fraction} if gpus > 0 else {"cpu": 1}
        trainable = tune.with_resources(_trial, resources)
        param_space = {"train_config": {**train_config, "seed": tune.grid_search(list(range(k)))},
                       "fraction": fraction}
        t0 = time.perf_counter()
        results = tune.Tuner(trainable, param_space=param_space,
                             tune_config=tune.TuneConfig(max_concurrent_trials=k),
                             run_config=tune.RunConfig(name=f"packing-k{k}", verbose=0,
                                                       storage_path=f"/tmp/cowtune-packing-{int(t0)}")).fit()
        wall = time.perf_counter() - t0
        if any(r.error for r in results) or sum(1 for r in results if r.metrics) != k:
            raise RuntimeError(f"packing k={k}: {sum(1 for r in results if r.error)} of {k} trials failed")
        rates, rates_with_eval = concurrent_rates([r.metrics_dataframe for r in results],
                                                  train_config["train"]["steps_per_epoch"], k)
        rows.append({"k": k, "gpu_fraction": fraction, "aggregate_steps_per_s": sum(rates),
                     "aggregate_with_eval_steps_per_s": sum(rates_with_eval),
                     "per_trial_steps_per_s": sum(rates) / k,
                     "peak_mem_gib": max(r.metrics.get("peak_mem_gib", 0.0) for r in results), "wall_s": wall})
    base = rows[0]["per_trial_steps_per_s"] if rows and rows[0]["k"] == 1 else None
    for row in rows:
        row["slowdown"] = base / row["per_trial_steps_per_s"] if base else float("nan")
    return rows


def concurrent_rates(frames: list[Any], steps_per_epoch: int, k: int) -> tuple[list[float], list[float]]:
    """Each trial's steps/s over the epochs it ran while all k trials were past their first epoch and
    none had finished (trials start and compile at different times): from its training time alone, and
    from the wall time between its epoch reports (evaluation and checkpoint included)."""
    start = max(f["wall_time"].iloc[0] for f in frames)    # every trial has compiled and run an epoch
    end = min(f["wall_time"].iloc[-1] for f in frames)     # no trial has finished yet
    rates, with_eval = [], []
    for f in frames:
        inside = f[(f["wall_time"] >= start) & (f["wall_time"] <= end)]
        if len(inside) < 2:
            raise RuntimeError(f"packing k={k}: the {k} trials overlapped for too few epochs to measure; "
                               f"pass more --epochs (or --steps)")
        epochs = inside.iloc[1:]   # epochs that began and ended inside the window
        rates.append(float(epochs["train/steps_per_s"].mean()))
        with_eval.append((len(inside) - 1) * steps_per_epoch / float(inside["wall_time"].iloc[-1] - inside["wall_time"].iloc[0]))
    return rates, with_eval


def print_packing(rows: list[dict[str, float]]) -> None:
    print(f"{'k':>3}  {'GPU share':>9}  {'aggregate steps/s':>17}  {'with eval':>9}  {'per trial':>9}  {'slowdown':>8}  "
          f"{'peak GiB':>8}  {'wall s':>6}")
    for r in rows:
        print(f"{r['k']:>3}  {r['gpu_fraction']:>9.3f}  {r['aggregate_steps_per_s']:>17.1f}  "
              f"{r['aggregate_with_eval_steps_per_s']:>9.1f}  "
              f"{r['per_trial_steps_per_s']:>9.1f}  {r['slowdown']:>7.2f}x  {r['peak_mem_gib']:>8.2f}  {r['wall_s']:>6.0f}")
