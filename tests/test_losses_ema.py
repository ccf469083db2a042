import math

import pytest
import torch
from torch import nn

from trainables.ssl.ema import EmaPairs, ema_update_, ema_weight, make_teacher
from trainables.ssl.losses import confidence_weight, mix_targets, squared_error


def test_squared_error_hand_computed():
    # softmax([0, 0]) = [0.5, 0.5]; softmax([ln 3, 0]) = [0.75, 0.25]
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    target = torch.tensor([[1.0, 0.0], [0.75, 0.25]])
    # sample 0: 0.25 + 0.25 = 0.5; sample 1: 0
    assert squared_error(logits, target, torch.tensor([1.0, 1.0])).item() == pytest.approx(0.25)
    # weights mask sample 0 out; division stays by the full batch (2)
    assert squared_error(logits, target, torch.tensor([0.0, 1.0])).item() == pytest.approx(0.0)
    assert squared_error(logits, target, torch.tensor(0.5)).item() == pytest.approx(0.125)


def test_confidence_weight_strict_and_average():
    conf = torch.tensor([0.5, 0.6, 0.7, 0.9])
    w, rate = confidence_weight(conf, 0.6, average=False)
    assert w.tolist() == [0.0, 0.0, 1.0, 1.0]           # strict '>'
    assert rate.item() == pytest.approx(0.5)
    w, rate = confidence_weight(conf, 0.6, average=True)
    assert w.dim() == 0 and w.item() == pytest.approx(0.5)
    w, _ = confidence_weight(conf, 0.0, average=False)
    assert w.tolist() == [1.0, 1.0, 1.0, 1.0]


def test_mix_targets_blend_probabilities_with_rolled_partner():
    logits = torch.log(torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.5, 0.5]]))
    blend = torch.tensor([0.25, 0.5, 1.0])
    target, conf = mix_targets(logits, blend, mix_logits=False, conf_mode="mix_conf")
    # sample 0 mixes with sample 1, sample 2 with sample 0
    assert torch.allclose(target[0], torch.tensor([0.75 * 0.9 + 0.25 * 0.2, 0.75 * 0.1 + 0.25 * 0.8]))
    assert torch.allclose(target[2], torch.tensor([0.9, 0.1]))
    assert conf[0].item() == pytest.approx(0.75 * 0.9 + 0.25 * 0.8)   # blended confidences
    _, conf_prob = mix_targets(logits, blend, mix_logits=False, conf_mode="mix_prob")
    assert conf_prob[0].item() == pytest.approx(0.75 * 0.9 + 0.25 * 0.2)  # max of the blended target
    target_l, _ = mix_targets(logits, blend, mix_logits=True, conf_mode="mix_conf")
    mid = torch.softmax(0.75 * logits[0] + 0.25 * logits[1], 0)
    assert torch.allclose(target_l[0], mid)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x))


def test_ema_arithmetic_params_and_bn_buffers():
    torch.manual_seed(0)
    student = Net()
    teacher = make_teacher(student)
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    student.train()
    student(torch.randn(8, 3, 6, 6))                      # moves BN running stats
    with torch.no_grad():
        student.conv.weight.add_(1.0)
    t_before = {k: v.clone() for k, v in teacher.state_dict().items()}
    s_now = {k: v.clone() for k, v in student.state_dict().items()}
    ema_update_(EmaPairs(teacher, student), 0.9)
    for k, v in teacher.state_dict().items():
        if v.is_floating_point():
            assert torch.allclose(v, 0.9 * t_before[k] + 0.1 * s_now[k], atol=1e-6), k
        else:
            assert torch.equal(v, s_now[k]), k                # num_batches_tracked copied
    assert not torch.equal(teacher.bn.running_mean, t_before["bn.running_mean"])


def test_ema_edge_cases_and_tensor_alpha():
    torch.manual_seed(1)
    student = Net()
    teacher = make_teacher(student)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(torch.randn_like(p))
    frozen = {k: v.clone() for k, v in teacher.state_dict().items()}
    pairs = EmaPairs(teacher, student)
    ema_update_(pairs, 1.0)                                 # alpha 1 freezes the teacher
    assert torch.equal(teacher.conv.weight, frozen["conv.weight"])
    ema_update_(pairs, torch.tensor(0.0))                   # alpha 0 copies the student
    assert torch.equal(teacher.conv.weight, student.conv.weight)


def test_ema_with_device_scalars_matches_host_floats_bit_for_bit():
    """A captured CUDA-graph step passes alpha and 1 - alpha as 0-dim tensors filled from host floats;
    the eager step passes floats. Both must give the very same teacher (resume may switch modes)."""
    torch.manual_seed(2)
    student = Net()
    teachers = [make_teacher(student), make_teacher(student)]
    with torch.no_grad():
        for p in student.parameters():
            p.add_(torch.randn_like(p))
    for alpha in (0.97, 0.999, 0.3):
        ema_update_(EmaPairs(teachers[0], student), alpha)
        ema_update_(EmaPairs(teachers[1], student), torch.tensor(alpha), torch.tensor(ema_weight(alpha)))
    for (k, a), b in zip(teachers[0].state_dict().items(), teachers[1].state_dict().values()):
        assert torch.equal(a, b), k


def test_cuda_graph_setting_is_checked_and_cpu_steps_are_never_captured():
    from trainables.config import TrainConfig
    from trainables.fast.switch import FastStep
    from trainables.optim import make_optimizer
    from trainables.step import StepRunner
    from trainables.validation import ConfigError

    with pytest.raises(ConfigError, match="train.fast.cuda_graph"):
        TrainConfig.from_dict({"train": {"cuda_graph": "whole"}})
    cfg = TrainConfig.from_dict({"model": "cnn_tiny", "mix": {"name": "cowmix"}, "train": {"cuda_graph": "step"}})
    student = Net()
    runner = StepRunner(cfg, student, make_teacher(student), make_optimizer(student, cfg.optim, 8),
                        torch.device("cpu"), False, fast=FastStep)
    assert runner.fast.step_graph is None and runner.cuda_graph == "none"


def test_ema_weights_sum_to_one_in_float32():
    """w = 1 - float32(alpha), so float32(alpha) + w == 1 exactly and a settled teacher is the student,
    not a scaled copy (w = float32(1 - alpha) misses 1 by up to 1.7e-4 relative at alpha 0.9999)."""
    f32 = lambda x: torch.tensor(x, dtype=torch.float32).item()   # the float32 value, as an exact double
    missed = 0
    for alpha in (0.5, 0.9, 0.97, 0.99, 0.995, 0.999, 0.9995, 0.9999):
        assert f32(alpha) + f32(ema_weight(alpha)) == 1.0, alpha          # exact sum, in double precision
        missed += f32(alpha) + f32(1.0 - alpha) != 1.0
    assert missed > 0   # the naive weight really is off for some of these


def test_compiled_ema_serves_every_alpha_and_matches_eager():
    """The trainer compiles the EMA with alpha and 1 - alpha as device scalars: one compilation for every alpha
    (annealed each step), and the traced graph computes the eager update's values. (The counting backend runs the
    traced graph as it is; Inductor's kernels are checked on a GPU, benchmarks/gpu_checks.py.)"""
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    student = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    student(torch.randn(2, 3, 6, 6))   # batch-norm statistics that differ from the teacher's
    other = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))   # the teachers start elsewhere, both alike
    teachers = [make_teacher(other) for _ in range(2)]
    counter = CompileCounter()
    compiled = torch.compile(ema_update_, backend=counter, dynamic=False)
    for alpha in (0.9, 0.99, 0.999):
        ema_update_(EmaPairs(teachers[0], student), alpha)
        compiled(EmaPairs(teachers[1], student), torch.tensor(alpha), torch.tensor(ema_weight(alpha)))
    assert counter.frame_count == 1
    for a, b in zip(teachers[0].state_dict().values(), teachers[1].state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
