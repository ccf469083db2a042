"""Correctness of the GPU fast path, run on a GPU machine (CI has none).

1. The compiled, CUDA-graphed bf16 step gives the same losses as the eager float32 step on the
   same batches (to bf16 precision).
2. A run stopped after one epoch and resumed ends with the same weights as one that ran straight
   through, with compilation and CUDA graphs on (deterministic cuDNN).

    python benchmarks/gpu_checks.py
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainables import metrics as M  # noqa: E402
from trainables.config import TrainConfig  # noqa: E402
from trainables.data import prepare_data  # noqa: E402
from trainables.models import create_model  # noqa: E402
from trainables.optim import make_optimizer  # noqa: E402
from trainables.ssl.ema import make_teacher  # noqa: E402
from trainables.step import StepRunner  # noqa: E402
from trainables.trainer import fit  # noqa: E402


def config(**train) -> TrainConfig:
    return TrainConfig.from_dict({
        "model": "wrn28_2", "data": {"dataset": "digits", "n_val": 300, "n_labeled": 50},
        "mix": {"name": "cowmix", "conf_thresh": 0.0},
        "train": {"batch_size": 64, "device": "cuda", "epochs": 2, "steps_per_epoch": 8, **train}})


def check_losses() -> bool:
    device = torch.device("cuda")
    fast_cfg = config(precision="bf16", compile=True)
    plain_cfg = config(precision="fp32", compile=False, channels_last=False)
    data = prepare_data(plain_cfg.data, 0, device)
    runners = []
    for cfg, bf16 in ((plain_cfg, False), (fast_cfg, True)):
        torch.manual_seed(0)
        student = create_model(cfg.model, 10).to(device)
        if bf16:
            student = student.to(memory_format=torch.channels_last)
        runners.append(StepRunner(cfg, student, make_teacher(student), make_optimizer(student, cfg.optim, 64),
                                  device, bf16))
    batch = next(iter(data.train_batches(0, 0, 64, 1, False)))
    for r in runners:  # one step from the same weights: the losses of the same batch
        r.step(batch, torch.Generator(device=device).manual_seed(1), 0.05, 0.97)
    plain, fast = (r.read_metrics() for r in runners)
    ok = True
    for key in (M.LOSS_SUP, M.LOSS_MIX, M.MIX_CONF_RATE):
        rel = abs(plain[key] - fast[key]) / max(abs(plain[key]), 1e-3)
        print(f"  {key}: eager fp32 {plain[key]:.5f}  compiled bf16 {fast[key]:.5f}  rel diff {rel:.3%}")
        ok &= rel < 0.03
    return ok


def check_resume() -> bool:
    cfg = config(compile=True, deterministic=True)
    data = prepare_data(cfg.data, 0, torch.device("cuda"))
    with tempfile.TemporaryDirectory() as tmp:
        fit(cfg, Path(tmp) / "straight", data=data, log=lambda s: None)

        def stop(epoch, metrics, path):
            raise KeyboardInterrupt

        try:
            fit(cfg, Path(tmp) / "resumed", data=data, report=stop, log=lambda s: None)
        except KeyboardInterrupt:
            pass
        fit(cfg, Path(tmp) / "resumed", data=data, log=lambda s: None)
        a = torch.load(Path(tmp) / "straight" / "checkpoint.pt", weights_only=False)
        b = torch.load(Path(tmp) / "resumed" / "checkpoint.pt", weights_only=False)
    diff = max((a["student"][k].float() - b["student"][k].float()).abs().max().item() for k in a["student"])
    print(f"  resume: epochs {a['epoch']} / {b['epoch']}, max |weight difference| {diff:.3g}")
    return a["epoch"] == b["epoch"] == 2 and diff == 0.0


def main() -> int:
    print(f"# GPU checks on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    results = {"losses": check_losses(), "resume": check_resume()}
    for name, ok in results.items():
        print(f"{name}: {'OK' if ok else 'FAILED'}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
