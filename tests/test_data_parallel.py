"""Data-parallel training (trainables/data_parallel.py) is one process's run split over workers: CPU, gloo.

The workers are real processes meeting in real collectives (torch.distributed over gloo); the model is tiny.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainables import data as D
from trainables.config import DataConfig, TrainConfig
from trainables.data_parallel import launch_local
from trainables.validation import ConfigError

CPU = torch.device("cpu")


def _config(method: str = "supervised", lr: float = 0.2, **train) -> TrainConfig:
    paths = {"supervised": {"mix": None, "perturb": None},
             "cowmix": {"mix": {"name": "cowmix", "sigma_range": [1.0, 4.0], "prop_range": [0.2, 0.8],
                                "weight": 1.0, "conf_thresh": 0.0}}}[method]
    return TrainConfig.from_dict({
        "seed": 0, "model": "cnn_tiny", "data": {"dataset": "digits", "n_val": 200, "n_labeled": 60},
        "optim": {"lr_per_256": lr, "schedule": "constant"},
        "train": {"batch_size": 16, "epochs": 2, "steps_per_epoch": 4, "eval_batch_size": 64, "device": "cpu",
                  "threads": 1, "compile": False, **train}, **paths})


@pytest.mark.parametrize("twice", [False, True])
def test_each_workers_slice_is_its_part_of_one_process_batch(twice):
    digits = D.prepare_data(DataConfig(dataset="digits", n_val=100, n_labeled=40), 0, CPU)
    whole = list(digits.train_batches(3, 7, 12, 5, twice))
    slices = [list(digits.train_batches(3, 7, 12, 5, twice, shard=(r, 3))) for r in range(3)]
    for step, batch in enumerate(whole):
        for name, field in zip(("x_sup", "y_sup", "x_unsup0", "x_unsup1"), dataclasses.astuple(batch)):
            parts = [dataclasses.astuple(s[step])[("x_sup", "y_sup", "x_unsup0", "x_unsup1").index(name)]
                     for s in slices]
            assert all(p.shape[0] == 4 for p in parts)
            assert torch.equal(torch.cat(parts), field), (step, name)


def test_a_batch_that_the_workers_cannot_split_is_refused_in_one_line():
    digits = D.prepare_data(DataConfig(dataset="digits", n_val=100, n_labeled=40), 0, CPU)
    with pytest.raises(ConfigError, match=r"train.batch_size must be divisible by the 3 data-parallel workers"):
        next(iter(digits.train_batches(0, 0, 16, 1, False, shard=(0, 3))))
    with pytest.raises(ConfigError, match=r"train.bn_batch must divide each of the 4 workers' 4 images"):
        launch_local(_config(bn_batch=8), 4, Path("/nonexistent-never-made"))


@pytest.mark.slow
def test_two_workers_train_the_weights_one_process_trains_and_resume_exactly(tmp_path):
    """Supervised steps have no per-worker randomness: 2 workers with batch-norm statistics per worker (8 images)
    must reach the weights of 1 process normalising in groups of 8 (train.bn_batch), to float rounding; and a run
    stopped after epoch 1 and resumed ends with the uninterrupted run's weights, bit for bit."""
    two = launch_local(_config(), 2, tmp_path / "two")
    one = launch_local(_config(bn_batch=8), 1, tmp_path / "one")
    a = torch.load(tmp_path / "two" / "state.pt", weights_only=True)["student"]
    b = torch.load(tmp_path / "one" / "state.pt", weights_only=True)["student"]
    params = [k for k in a if "running" not in k and "num_batches" not in k]
    assert params and all(torch.allclose(a[k], b[k], atol=1e-5, rtol=1e-4) for k in params)
    assert [m["epoch"] for m in two] == [1, 2] and all(m["world_size"] == 2 for m in two)
    assert all(m["replica_spread"] == 0.0 for m in two)
    assert two[-1]["train/loss_sup"] == pytest.approx(one[-1]["train/loss_sup"], rel=1e-4)   # the whole batch's
    # resume: epoch 1, a new set of processes from its state, epoch 2
    launch_local(_config(), 2, tmp_path / "resumed", epochs=1)
    launch_local(_config(), 2, tmp_path / "resumed", resume=True)
    c = torch.load(tmp_path / "resumed" / "state.pt", weights_only=True)
    assert c["epoch"] == 2 and all(torch.equal(a[k], c["student"][k]) for k in a)


@pytest.mark.slow
def test_cowmix_on_two_workers_keeps_the_replicas_identical_and_learns(tmp_path):
    """Each worker mixes its own slice with its own masks; the students and the teachers (weights and batch-norm
    statistics, averaged over the workers every step) stay identical."""
    history = launch_local(_config("cowmix", lr=2.0, epochs=3, steps_per_epoch=12), 2, tmp_path)
    assert all(m["replica_spread"] == 0.0 and m["world_size"] == 2 for m in history)
    assert all(m["train/loss_mix"] >= 0 for m in history)
    assert history[-1]["train/loss_sup"] < history[0]["train/loss_sup"] - 0.5   # here 2.22 -> 1.46
    assert history[-1]["val/error_student"] < 0.8    # ten classes: chance is 0.9 (here 0.58)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (run on the device machine)")
def test_two_gpu_workers_capture_the_all_reduce_in_the_step_graph_and_exit(tmp_path):
    """On 2 GPUs (NCCL) each worker's whole step is one CUDA graph holding the gradient all-reduce; the replicas
    stay identical, and the workers exit: a graph that captured an NCCL collective must be freed before the process
    group is destroyed, or ncclCommDestroy waits forever (pytorch/pytorch#115388). Run in a child process with a
    time limit so that a hang fails the test instead of blocking the suite."""
    cfg = _config("cowmix", lr=2.0, epochs=2, steps_per_epoch=6, device="cuda", cuda_graph="step",
                  precision="fp32", threads=None)
    script = ("import json, sys; from pathlib import Path; from trainables.config import TrainConfig; "
              "from trainables.data_parallel import launch_local\n"
              "if __name__ == '__main__':\n"
              "    h = launch_local(TrainConfig.from_dict(json.loads(sys.argv[1])), 2, Path(sys.argv[2]))\n"
              "    print(json.dumps(h[-1]))")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-c", script, json.dumps(cfg.to_dict()), str(tmp_path / "run")],
                            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)   # the launcher and its two workers
        stdout, stderr = proc.communicate()
        pytest.fail(f"the 2-GPU run did not exit in 300 s; metrics written: {(tmp_path / 'run' / 'metrics.jsonl').exists()}")
    assert proc.returncode == 0, stderr[-3000:]
    last = json.loads(stdout.strip().splitlines()[-1])
    assert last["replica_spread"] == 0.0 and last["world_size"] == 2 and last["epoch"] == 2
