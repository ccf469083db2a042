"""Digests of the weights that a few short training runs end with, to show that a change moved code and nothing else.

Trains each case below from the same seed on the CPU (or ``--device cuda``: there with ``train.deterministic``, and
the fast path's GPU parts: compiled, one CUDA graph a step, bf16, our kernels) and prints one SHA-256 of the student,
the teacher and the optimiser state a case, as JSON. Run it before and after a refactoring and compare:

    python benchmarks/weights_digest.py > /tmp/before.json        # at the old commit
    python benchmarks/weights_digest.py | diff /tmp/before.json -  # at the new one: no output, the same weights

The cases cover the plain step and the CPU side of the fast path's switches: one student call a batch or the
batches stacked with per-batch batch norm, ghost batch norm, both consistency paths, every regularizer, a
shake-shake model, ``train.fast`` false (the plain step), and the step's glue compiled with Inductor.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script from anywhere: the repo's packages

BASE = {"seed": 0, "model": "cnn_tiny", "data": {"dataset": "digits", "n_val": 200, "n_labeled": 30},
        "optim": {"lr_per_256": 0.5, "schedule": "constant"},
        "train": {"batch_size": 16, "epochs": 2, "steps_per_epoch": 3, "eval_batch_size": 256, "device": "cpu"}}

LOW = ["perturb.conf_thresh=0.105", "mix.conf_thresh=0.105"]   # the tiny untrained CNN: about 0.1-0.15
CASES = {   # --set overrides over BASE, as `cowtune train` takes them
    "cowmix": ["mix.name=cowmix"],
    "cowout": ["perturb.name=cowout"],
    "cowout+cowmix, one call a batch": ["perturb.name=cowout", "mix.name=cowmix",
                                        "train.fast.stack_student_calls=false"],
    "cowout+cowmix, stacked": ["perturb.name=cowout", "mix.name=cowmix", "train.fast.stack_student_calls=true"],
    "cowmix, ghost batch norm 4": ["mix.name=cowmix", "train.bn_batch=4"],
    "shake-shake cowmix": ["mix.name=cowmix", "model=wrn26_2_shakeshake", "train.batch_size=4",
                           "train.steps_per_epoch=2"],
    "cowmix, compiled": ["mix.name=cowmix", "train.fast.compile=true"],
    # thresholds low enough that the consistency losses are not 0 in these few steps
    "cowout+cowmix, compiled, low thresholds": ["perturb.name=cowout", "mix.name=cowmix", "train.fast.compile=true",
                                                *LOW],
    "cowout+cowmix, plain step (train.fast false)": ["perturb.name=cowout", "mix.name=cowmix", "train.fast=false",
                                                     *LOW],
    "supervised": [],
    "mean teacher": ["perturb.name=mean_teacher", "perturb.conf_thresh=0.105"],
    "randerase+ict": ["perturb.name=randerase", "perturb.apply_prob=0.5", "mix.name=ict", *LOW],
    "cutmix, per-sample confidence": ["mix.name=cutmix", "mix.conf_avg=false", "mix.conf_thresh=0.11"],
    "randerase+ict, plain step": ["perturb.name=randerase", "perturb.apply_prob=0.5", "mix.name=ict", *LOW,
                                  "train.fast=false"],
    "cutmix fixed, plain step": ["mix.name=cutmix", "mix.scale_mode=fixed", "mix.conf_thresh=0.105",
                                 "train.fast=false"],
    "cutmix fixed, compiled": ["mix.name=cutmix", "mix.scale_mode=fixed", "mix.conf_thresh=0.105",
                               "train.fast.compile=true"],
}


def digest(state: object, h: "hashlib._Hash") -> None:
    """Feed every tensor of a nested state (dicts in key order, lists in order) into ``h``."""
    import torch

    if isinstance(state, torch.Tensor):
        h.update(str((state.dtype, tuple(state.shape))).encode())
        h.update(state.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    elif isinstance(state, dict):
        for k in sorted(state, key=str):
            h.update(str(k).encode())
            digest(state[k], h)
    elif isinstance(state, (list, tuple)):
        for v in state:
            digest(v, h)
    else:
        h.update(repr(state).encode())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--only", action="append", default=[], metavar="CASE", help="run this case (repeatable)")
    args = p.parse_args()

    import torch

    from trainables.config import TrainConfig
    from trainables.presets import apply_overrides
    from trainables.trainer import fit

    out = {}
    for name, case in CASES.items():
        if args.only and name not in args.only:
            continue
        # on a GPU, deterministic cuDNN (else two processes may time different algorithms and round differently)
        where = [f"train.device={args.device}", f"train.deterministic={args.device != 'cpu'}"]
        cfg = TrainConfig.from_dict(apply_overrides(copy.deepcopy(BASE), [*case, *where]))
        with tempfile.TemporaryDirectory() as tmp:
            fit(cfg, tmp, log=lambda s: None)
            ckpt = torch.load(Path(tmp) / "checkpoint.pt", map_location="cpu", weights_only=True)
        h = hashlib.sha256()
        for part in ("student", "teacher", "optimizer"):
            digest(ckpt[part], h)
        out[name] = h.hexdigest()[:16]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
