"""Compile a search's training step on the driver's GPU while Ray starts and the first trials set up.

A trial compiles its step (Dynamo, Inductor, cuDNN tuning, CUDA-graph capture) at its first step;
with empty compile caches that is the longest wait of a search (WRN-28-2 CowMix on H100 hosts:
46-69 s), and a trial only gets there some 40 s after launch (driver imports, MLflow, Ray, worker
start, data). The driver therefore starts ``python -m trainables.search.compile_ahead`` at once: a process
that builds the step exactly as a trial does (``trainer.setup_device``, ``build_runner``,
``train_epoch`` with one step, same data) and runs that first step under the machine's
first-compile lock (``trainables.fast.compile_lock``); on an H100 host its compilation began about 17 s
after launch instead of 40. Trials that get there first wait for it, then load its graphs and
kernels from Inductor's on-disk caches (16-21 s for four at once: Dynamo still traces each process's
code, and cuDNN tunes per process), so what it saves is that head start less the trials' own load.
Where a step like it has compiled on the machine before, it exits at once and the trials compile
from the warm caches. It trains nothing that is kept and touches no trial's random streams; if it
fails, the trials compile for themselves, as without it.

    proc = start(cfg)                      # None where the driver has no GPU or cfg does not compile
    python -m trainables.search.compile_ahead CONFIG.json   # what it runs; prints one line when done
"""
from __future__ import annotations

import atexit
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from trainables.child_process import module_command
from trainables.config import TrainConfig

TIMEOUT_S = 900.0   # as long as a trial waits for the first-compile lock before compiling itself


def reason_not_to(cfg: TrainConfig) -> str | None:
    """Why compiling ahead on this machine would not help the trials of ``cfg``; None when it would."""
    import torch

    if cfg.train.device != "auto" and not cfg.train.device.startswith("cuda"):
        return f"trials run on {cfg.train.device}"
    if cfg.train.fast.compile is False:
        return "train.fast.compile is off"
    if not torch.cuda.is_available():
        return "no GPU on this machine"
    return None


def start(cfg: TrainConfig, log: Callable[[str], None] = print, timeout_s: float = TIMEOUT_S
          ) -> subprocess.Popen | None:
    """Start compiling ``cfg``'s step in a background process; returns it, or None (and says why) when
    there is nothing to gain. A watcher thread says when it ends and stops it after ``timeout_s``."""
    why = reason_not_to(cfg)
    if why is not None:
        log(f"compile ahead: skipped ({why})")
        return None
    work = Path(tempfile.mkdtemp(prefix="cowtune-compile-ahead-"))
    (work / "config.json").write_text(json.dumps(cfg.to_dict()))
    argv, env = module_command("trainables.search.compile_ahead", str(work / "config.json"))
    out = open(work / "compile.log", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    out.close()
    log(f"compile ahead: compiling the {cfg.model} {cfg.method} step in the background (pid {proc.pid}, "
        f"log {work / 'compile.log'}); trials load what it compiles")

    def watch() -> None:
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            log(f"compile ahead: stopped after {timeout_s:.0f} s; the trials compile for themselves")
            return
        tail = (work / "compile.log").read_text(errors="replace").strip().splitlines()[-1:] or [""]
        if code == 0:
            log(f"{tail[0]} ({time.monotonic() - t0:.0f} s after it started)")
        else:
            log(f"compile ahead: failed (exit {code}; {work / 'compile.log'}); the trials compile for themselves")

    threading.Thread(target=watch, name="cowtune-compile-ahead", daemon=True).start()
    atexit.register(lambda: proc.poll() is None and proc.kill())   # the driver stopping takes it along
    return proc


def compile_step(cfg: TrainConfig) -> dict[str, float] | None:
    """Build the step as a trial does and run its first step; returns the runner's first-step timings, or
    None when a step like it has compiled on this machine before (trials then compile at once, from the
    warm caches, and one more process compiling beside them would only slow them down)."""
    from trainables.data import prepare_data
    from trainables.fast.compile_lock import compiled_before
    from trainables.fast.switch import compile_key, compile_locked
    from trainables.trainer import build_runner, setup_device, train_epoch

    device = setup_device(cfg)
    data = prepare_data(cfg.data, cfg.labeled_seed, device, cfg.train.fast.compile)
    runner = build_runner(cfg, data.num_classes, device)
    augment_twice = cfg.perturb is not None and cfg.perturb.regularizer.augment_twice
    # a chunk of steps, as a trial's epoch has them: the augmentation compiles for the shape the trials augment at
    # (trainables.data.device)
    steps = min(getattr(data, "chunk_steps", 1),
                cfg.train.steps_per_epoch or data.default_steps_per_epoch(cfg.train.batch_size))
    batch = next(iter(data.train_batches(0, cfg.seed, cfg.train.batch_size, steps, augment_twice)))
    if compile_locked(runner) and compiled_before(compile_key(runner, batch)):
        return None
    train_epoch(cfg, runner, data, 0, steps, runner.optimizer.param_groups[0]["lr"])
    return runner.first_step or {}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m trainables.search.compile_ahead CONFIG.json", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    cfg = TrainConfig.from_dict(json.loads(Path(argv[0]).read_text()))
    from trainables.fast.compile_options import tune_kernels_by_default

    tune_kernels_by_default(False)   # as the search's trials compile it (trainables.search.trial)
    timings = compile_step(cfg)
    from trainables import metrics as M

    if timings is None:
        print(f"compile ahead: the {cfg.model} {cfg.method} step has compiled on this machine before; "
              "the trials load it from the caches", flush=True)
        return 0
    print(f"compile ahead: compiled the {cfg.model} {cfg.method} step "
          f"(first step {timings.get(M.FIRST_STEP_S, float('nan')):.1f} s, "
          f"{time.monotonic() - t0:.1f} s with set-up)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
