"""Compiling a search's step ahead of its trials: a trial after it loads every graph from the caches it
filled, and the driver starts it only where a GPU can use it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainables.config import TrainConfig
from trainables.search import compile_ahead

ROOT = Path(__file__).resolve().parents[1]

CONFIG = {"seed": 3, "model": "cnn_tiny", "mix": {"name": "cowmix"},
          "data": {"dataset": "digits", "n_val": 200, "n_labeled": 30},
          "train": {"batch_size": 16, "epochs": 1, "steps_per_epoch": 2, "device": "cpu", "compile": True}}

TRIAL = """
import json, sys, torch
from torch._dynamo.utils import counters
from trainables.config import TrainConfig
from trainables.trainer import fit
fit(TrainConfig.from_dict(json.loads(sys.argv[1])), sys.argv[2], log=lambda s: None)
print("COUNTERS " + json.dumps({"fx": dict(counters["inductor"]), "aot": dict(counters["aot_autograd"])}))
"""


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton"),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _start_trial(cache: Path, out: Path) -> tuple[subprocess.Popen, Path]:
    out.mkdir(parents=True)
    log = out.parent / f"{out.name}.log"   # a file, not a pipe: nothing blocks while the test waits on another
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-c", TRIAL, json.dumps(CONFIG), str(out)], env=_env(cache),
                                stdout=f, stderr=subprocess.STDOUT, text=True), log


def _trial_counters(started: tuple[subprocess.Popen, Path]) -> dict:
    proc, log = started
    assert proc.wait(600) == 0, log.read_text()[-3000:]
    return json.loads(next(line[9:] for line in log.read_text().splitlines() if line.startswith("COUNTERS ")))


def test_a_trial_after_compile_ahead_loads_every_graph(tmp_path):
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps(CONFIG))
    # the control, meanwhile, on caches of its own: without compile ahead, the same trial compiles from scratch
    # (so the check below can tell the two apart)
    alone = _start_trial(tmp_path / "empty", tmp_path / "trial2")
    r = subprocess.run([sys.executable, "-m", "trainables.search.compile_ahead", str(cfg_file)], env=_env(tmp_path),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "compile ahead: compiled the cnn_tiny cowmix step (first step" in r.stdout
    after = _trial_counters(_start_trial(tmp_path, tmp_path / "trial"))
    assert after["fx"].get("fxgraph_cache_hit", 0) >= 2 and "fxgraph_cache_miss" not in after["fx"]   # student, teacher
    assert after["aot"].get("autograd_cache_hit", 0) >= 2 and "autograd_cache_miss" not in after["aot"]
    alone = _trial_counters(alone)
    assert alone["fx"].get("fxgraph_cache_miss", 0) >= 2 and "fxgraph_cache_hit" not in alone["fx"]


def test_start_only_where_a_gpu_would_use_it():
    said: list[str] = []
    cpu = TrainConfig.from_dict(CONFIG)
    assert compile_ahead.start(cpu, log=said.append) is None
    assert said == ["compile ahead: skipped (trials run on cpu)"]
    off = TrainConfig.from_dict({**CONFIG, "train": {**CONFIG["train"], "device": "auto", "compile": False}})
    assert compile_ahead.reason_not_to(off) == "train.fast.compile is off"
    auto = TrainConfig.from_dict({**CONFIG, "train": {**CONFIG["train"], "device": "auto", "compile": None}})
    assert compile_ahead.reason_not_to(auto) == (None if torch.cuda.is_available() else "no GPU on this machine")


def test_bad_invocation_says_how_to_call_it():
    r = subprocess.run([sys.executable, "-m", "trainables.search.compile_ahead"], env=_env(Path("/nonexistent")),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "usage: python -m trainables.search.compile_ahead CONFIG.json" in r.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_start_runs_on_a_gpu(tmp_path):   # pragma: no cover - CI has no GPU
    cfg = TrainConfig.from_dict({**CONFIG, "train": {**CONFIG["train"], "device": "cuda"}})
    proc = compile_ahead.start(cfg, log=lambda s: None)
    assert proc is not None and proc.wait(600) == 0


def test_compiled_before_reads_the_marker_the_lock_leaves(tmp_path, monkeypatch):
    """compile_ahead exits at once where the step compiled before: it asks the lock's own marker."""
    from trainables.fast import compile_lock

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert compile_lock.cache_folder() == tmp_path
    assert not compile_lock.compiled_before("k1")
    with compile_lock.first_compile_lock("k1") as lock:
        assert lock == {"waited_s": 0.0} and not compile_lock.compiled_before("k1")
    assert compile_lock.compiled_before("k1") and not compile_lock.compiled_before("k2")
