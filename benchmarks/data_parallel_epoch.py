"""Time epochs of one config trained data-parallel on N local GPUs (``trainables.data_parallel``), without Ray.

Predicts the wall time of a data-parallel ``cowtune final`` run (issue 40: the paper's 300 epochs of the 27M
model on two GPUs) from a few epochs, and checks on real GPUs that the workers stay in sync over NCCL:

    python benchmarks/data_parallel_epoch.py cifar10_cowmix --world 2 --epochs 3 --out /tmp/dp \\
        --set data.dataset=imagefolder --set data.root=.devdata/train.zip --set data.n_val=5000 \\
        --set data.eval_split=val --set train.fast.tune_kernels=false

The first epoch includes compilation; the last epochs' mean time, scaled to ``train.epochs``, is the prediction.
Writes ``OUT/summary.json`` beside the run's ``metrics.jsonl`` and ``state.pt``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script from anywhere: the repo's packages


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", help="preset name or YAML")
    p.add_argument("--world", type=int, required=True, help="workers (GPUs)")
    p.add_argument("--epochs", type=int, default=3, help="epochs to run (the first one compiles)")
    p.add_argument("--out", required=True, help="folder for the run (emptied first)")
    p.add_argument("--save-every", type=int, default=1, help="write state.pt every N epochs (and after the last)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()

    import torch

    from trainables.data_parallel import launch_local
    from trainables.presets import load_config

    cfg = load_config(args.config, args.set)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    history = launch_local(cfg, args.world, out, epochs=args.epochs, save_every=args.save_every)
    timed = history[1:] or history
    epoch_s = sum(m["epoch_s"] for m in timed) / len(timed)
    steps = history[-1]["step"] / history[-1]["epoch"]
    summary = {
        "config": args.config, "overrides": args.set, "world": args.world, "model": cfg.model,
        "batch_per_worker": cfg.train.batch_size // args.world, "bn_batch": cfg.train.bn_batch,
        "steps_per_epoch": steps, "epoch_s": [round(m["epoch_s"], 2) for m in history],
        "steps_per_s": round(steps / epoch_s, 1),
        "predicted_run_min": round(epoch_s * cfg.train.epochs / 60, 1), "epochs_of_run": cfg.train.epochs,
        "replica_spread": [m["replica_spread"] for m in history],
        "error_teacher": [m.get("val/error_teacher", m.get("test/error_teacher")) for m in history],
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "torch": torch.__version__,
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
