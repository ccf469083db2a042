"""How many trials to pack on one GPU: k trials at once under Ray Tune, each asking 1/k of the GPU.

Each trial is the real trainer (``fit``) on GPU-resident data, capped to its share of GPU memory
with ``torch.cuda.set_per_process_memory_fraction``, as search trials are. Ray starts the k trials
seconds apart and their first epochs compile, so every trial waits after its first epoch until all
k have run one (a start barrier: files in a shared folder); the rates are read from the epochs that
ran after it while no trial had finished. Aggregate steps/s is what the GPU delivered to the k
trials: each trial's steps over the wall time between its epoch reports (evaluation and checkpoints
included), summed. "While stepping" is a trial's own rate while it ran its steps (its training time
less any wait for its turn with the GPU): about the single-trial rate when trials take turns, about
1/k of it when they time-slice. The slowdown is the single-trial rate over the per-trial rate.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def _trial(config: dict[str, Any]) -> None:
    from ray import tune

    from trainables import metrics as M
    from trainables.config import TrainConfig
    from trainables.data import prepare_data
    from trainables.trainer import fit, resolve_device

    cfg = TrainConfig.from_dict(config["train_config"])
    device = resolve_device(cfg.train.device)
    if device.type == "cuda" and config["fraction"] < 1:
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_per_process_memory_fraction(config["fraction"], index)
    data = prepare_data(cfg.data, cfg.labeled_seed, device, cfg.train.fast.compile)

    first = [True]

    def report(epoch, metrics, path):
        if first[0]:
            first[0] = False
            wait_for_all(Path(config["barrier"]), str(cfg.seed), config["k"])
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        stepping = metrics[M.TRAIN_S] - metrics.get(M.TURN_WAIT_S, 0.0)
        tune.report({**metrics, "peak_mem_gib": peak, "wall_time": time.time(),
                     "stepping_steps_per_s": config["train_config"]["train"]["steps_per_epoch"] / stepping})

    with tempfile.TemporaryDirectory() as out:
        fit(cfg, out, report=report, data=data, log=lambda s: None, shared_gpu=config["fraction"] < 1)


def wait_for_all(folder: Path, name: str, k: int, timeout_s: float = 900.0) -> None:
    """Start barrier: mark this trial as arrived, then wait until all ``k`` have."""
    (folder / name).touch()
    deadline = time.monotonic() + timeout_s
    while len(list(folder.iterdir())) < k:
        if time.monotonic() > deadline:
            raise TimeoutError(f"packing: only {len(list(folder.iterdir()))} of {k} trials reached their "
                               f"first epoch report within {timeout_s:.0f} s")
        time.sleep(0.05)


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
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"cowtune-packing-k{k}-") as work:
            barrier = Path(work) / "barrier"
            barrier.mkdir()
            param_space = {"train_config": {**train_config, "seed": tune.grid_search(list(range(k)))},
                           "fraction": fraction, "k": k, "barrier": str(barrier)}
            results = tune.Tuner(trainable, param_space=param_space,
                                 tune_config=tune.TuneConfig(max_concurrent_trials=k),
                                 run_config=tune.RunConfig(name=f"packing-k{k}", verbose=0, storage_path=work)).fit()
        wall = time.perf_counter() - t0
        if any(r.error for r in results) or sum(1 for r in results if r.metrics) != k:
            raise RuntimeError(f"packing k={k}: {sum(1 for r in results if r.error)} of {k} trials failed")
        rates, stepping = concurrent_rates([r.metrics_dataframe for r in results],
                                           train_config["train"]["steps_per_epoch"], k)
        rows.append({"k": k, "gpu_fraction": fraction, "aggregate_steps_per_s": sum(rates),
                     "per_trial_steps_per_s": sum(rates) / k,
                     "stepping_steps_per_s": sum(stepping) / k,
                     "peak_mem_gib": max(r.metrics.get("peak_mem_gib", 0.0) for r in results), "wall_s": wall})
    base = rows[0]["per_trial_steps_per_s"] if rows and rows[0]["k"] == 1 else None
    for row in rows:
        row["slowdown"] = base / row["per_trial_steps_per_s"] if base else float("nan")
    return rows


def concurrent_rates(frames: list[Any], steps_per_epoch: int, k: int) -> tuple[list[float], list[float]]:
    """Each trial's steps/s over the epochs it ran after the start barrier while no trial had finished:
    from the wall time between its epoch reports (evaluation and checkpoint included), and while it
    stepped (its training time less its wait for the GPU turn)."""
    start = max(f["wall_time"].iloc[0] for f in frames)    # every trial has compiled and run an epoch
    end = min(f["wall_time"].iloc[-1] for f in frames)     # no trial has finished yet
    rates, stepping = [], []
    for f in frames:
        inside = f[(f["wall_time"] >= start) & (f["wall_time"] <= end)]
        if len(inside) < 2:
            raise RuntimeError(f"packing k={k}: the {k} trials overlapped for too few epochs to measure; "
                               f"pass more --epochs (or --steps)")
        rates.append((len(inside) - 1) * steps_per_epoch / float(inside["wall_time"].iloc[-1] - inside["wall_time"].iloc[0]))
        stepping.append(float(inside.iloc[1:]["stepping_steps_per_s"].mean()))   # epochs begun and ended inside
    return rates, stepping


def print_packing(rows: list[dict[str, float]]) -> None:
    print(f"{'k':>3}  {'GPU share':>9}  {'aggregate steps/s':>17}  {'per trial':>9}  {'slowdown':>8}  "
          f"{'while stepping':>14}  {'peak GiB':>8}  {'wall s':>6}")
    for r in rows:
        print(f"{r['k']:>3}  {r['gpu_fraction']:>9.3f}  {r['aggregate_steps_per_s']:>17.1f}  "
              f"{r['per_trial_steps_per_s']:>9.1f}  {r['slowdown']:>7.2f}x  {r['stepping_steps_per_s']:>14.1f}  "
              f"{r['peak_mem_gib']:>8.2f}  {r['wall_s']:>6.0f}")
