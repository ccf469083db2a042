"""The compiled fast path computes the same losses and update as the plain eager path (CPU, float32)."""
import torch

from trainables import metrics as M
from trainables.config import TrainConfig
from trainables.data import prepare_data
from trainables.models import create_model
from trainables.optim import make_optimizer
from trainables.ssl.ema import make_teacher
from trainables.step import StepRunner


def runner(cfg: TrainConfig) -> StepRunner:
    torch.manual_seed(0)
    student = create_model(cfg.model, 10)
    teacher = make_teacher(student)
    return StepRunner(cfg, student, teacher, make_optimizer(student, cfg.optim, cfg.train.batch_size),
                      torch.device("cpu"), bf16=False)


def test_compiled_step_matches_eager_step():
    base = {"model": "cnn_tiny", "data": {"dataset": "digits", "n_val": 200, "n_labeled": 30},
            "perturb": {"name": "cowout", "conf_thresh": 0.0}, "mix": {"name": "cowmix", "conf_thresh": 0.0},
            "train": {"batch_size": 16, "device": "cpu", "precision": "fp32"}}
    eager_cfg = TrainConfig.from_dict({**base, "train": {**base["train"], "compile": False}})
    fast_cfg = TrainConfig.from_dict({**base, "train": {**base["train"], "compile": True}})
    data = prepare_data(eager_cfg.data, 0, torch.device("cpu"))
    batches = list(data.train_batches(0, 0, 16, 2, False))
    eager, fast = runner(eager_cfg), runner(fast_cfg)
    assert fast.student_forward is not fast.student  # really compiled
    for batch in batches:
        for r in (eager, fast):
            r.step(batch, torch.Generator().manual_seed(1), 0.1, 0.9)
    a, b = eager.read_metrics(), fast.read_metrics()
    for key in (M.LOSS_SUP, M.LOSS_CONS, M.LOSS_MIX):
        assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (key, a[key], b[key])
    for (name, p), q in zip(eager.student.named_parameters(), fast.student.parameters()):
        assert torch.allclose(p, q, atol=1e-4, rtol=1e-3), (name, (p - q).abs().max().item())
    for p, q in zip(eager.teacher.state_dict().values(), fast.teacher.state_dict().values()):
        assert torch.allclose(p.float(), q.float(), atol=1e-5, rtol=1e-4)
