"""How many trials to pack on one GPU: k trials at once under Ray Tune, each asking 1/k of the GPU.

Each trial is the real trainer (``fit``) on GPU-resident data, capped to its share of GPU memory
with ``torch.cuda.set_per_process_memory_fraction``, as search trials are. Steps/s per trial is
read from the last epoch (the first includes compilation). Aggregate steps/s is the sum over
the k trials ("with eval": over the whole last epoch, its evaluation and checkpoint included);
the slowdown is the single-trial rate over the mean per-trial rate.
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
        tune.report({**metrics, "peak_mem_gib": peak})

    with tempfile.TemporaryDirectory() as out:
        fit(cfg, out, report=report, data=data, log=lambda s: None)


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
        last = [r.metrics for r in results if r.metrics]
        if len(last) != k or any(r.error for r in results):
            raise RuntimeError(f"packing k={k}: {sum(1 for r in results if r.error)} of {k} trials failed")
        per_trial = [m["train/steps_per_s"] for m in last]
        steps = train_config["train"]["steps_per_epoch"]   # with each epoch's evaluation and checkpoint
        with_eval = sum(steps / m["time_this_iter_s"] for m in last)
        rows.append({"k": k, "gpu_fraction": fraction, "aggregate_steps_per_s": sum(per_trial),
                     "aggregate_with_eval_steps_per_s": with_eval,
                     "per_trial_steps_per_s": sum(per_trial) / k,
                     "peak_mem_gib": max(m.get("peak_mem_gib", 0.0) for m in last), "wall_s": wall})
    base = rows[0]["per_trial_steps_per_s"] if rows and rows[0]["k"] == 1 else None
    for row in rows:
        row["slowdown"] = base / row["per_trial_steps_per_s"] if base else float("nan")
    return rows


def print_packing(rows: list[dict[str, float]]) -> None:
    print(f"{'k':>3}  {'GPU share':>9}  {'aggregate steps/s':>17}  {'with eval':>9}  {'per trial':>9}  {'slowdown':>8}  "
          f"{'peak GiB':>8}  {'wall s':>6}")
    for r in rows:
        print(f"{r['k']:>3}  {r['gpu_fraction']:>9.3f}  {r['aggregate_steps_per_s']:>17.1f}  "
              f"{r['aggregate_with_eval_steps_per_s']:>9.1f}  "
              f"{r['per_trial_steps_per_s']:>9.1f}  {r['slowdown']:>7.2f}x  {r['peak_mem_gib']:>8.2f}  {r['wall_s']:>6.0f}")
