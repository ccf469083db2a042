"""Ghost batch norm (train.bn_batch): each group of rows normalised as its own batch, as the reference's
per-device statistics under pmap; running statistics moved once per call toward the groups' average."""
import copy

import pytest
import torch
import torch.nn.functional as F

from trainables.config import TrainConfig
from trainables.models import create_model
from trainables.optim import make_optimizer
from trainables.models.segmented_bn import SegmentedBatchNorm2d, batch_segments, segmentable, set_ghost_batch
from trainables.ssl.ema import make_teacher
from trainables.step import StepRunner
from trainables.validation import ConfigError


def _layer(ghost):
    torch.manual_seed(0)
    bn = SegmentedBatchNorm2d(3)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    bn.ghost = ghost
    return bn


@pytest.mark.parametrize("relu", [False, True])
def test_each_group_is_normalised_as_its_own_batch(relu):
    bn = _layer(4)
    x = torch.randn(12, 3, 5, 5, dtype=torch.float64) * 3 + 1
    bn.double()
    ref = copy.deepcopy(bn)
    ref.ghost = None
    y = bn.forward_relu(x) if relu else bn(x)
    groups = [F.batch_norm(g, None, None, ref.weight, ref.bias, True, 0.0, ref.eps) for g in x.split(4)]
    want = torch.cat(groups)
    torch.testing.assert_close(y, want.relu() if relu else want)
    # the running statistics moved once, toward the mean of the groups' means and unbiased variances
    means = torch.stack([g.mean((0, 2, 3)) for g in x.split(4)]).mean(0)
    variances = torch.stack([g.var((0, 2, 3), unbiased=True) for g in x.split(4)]).mean(0)
    torch.testing.assert_close(bn.running_mean, 0.9 * torch.zeros(3, dtype=torch.float64) + 0.1 * means)
    torch.testing.assert_close(bn.running_var, 0.9 * torch.ones(3, dtype=torch.float64) + 0.1 * variances)
    assert bn.num_batches_tracked.item() == 1


def test_gradients_are_those_of_separate_groups():
    bn = _layer(2).double()
    ref = copy.deepcopy(bn)
    ref.ghost = None
    x = torch.randn(6, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 3, 4, 4, dtype=torch.float64)
    (bn(x) * w).sum().backward()
    gx, gw = x.grad.clone(), bn.weight.grad.clone()
    x.grad = None
    out = torch.cat([F.batch_norm(g, None, None, ref.weight, ref.bias, True, 0.0, ref.eps) for g in x.split(2)])
    (out * w).sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, ref.weight.grad)


@pytest.mark.parametrize("one_pass", [False, True])
def test_stacked_call_matches_one_call_per_batch(one_pass, monkeypatch):
    """Stacked batches (each its own segment) give the same outputs and running statistics as separate calls,
    a frozen segment leaving the statistics alone, on the eager split path and the one-pass path."""
    monkeypatch.setattr(SegmentedBatchNorm2d, "one_pass_eager", one_pass)
    x1, x2 = torch.randn(8, 3, 4, 4, dtype=torch.float64), torch.randn(8, 3, 4, 4, dtype=torch.float64) + 2
    stacked, separate = _layer(4).double(), _layer(4).double()
    with batch_segments([stacked], ((8, True), (8, False))):
        y = stacked(torch.cat([x1, x2]))
    y1 = separate(x1)
    saved = separate.momentum
    separate.momentum = 0.0   # the frozen call of the reference
    y2 = separate(x2)
    separate.momentum = saved
    torch.testing.assert_close(y, torch.cat([y1, y2]))
    torch.testing.assert_close(stacked.running_mean, separate.running_mean)
    torch.testing.assert_close(stacked.running_var, separate.running_var)


def test_eval_mode_uses_running_statistics():
    bn = _layer(2).eval()
    x = torch.randn(4, 3, 3, 3)
    ref = copy.deepcopy(bn)
    ref.ghost = None
    torch.testing.assert_close(bn(x), ref(x))


def test_a_batch_that_is_not_whole_groups_is_named():
    bn = _layer(4)
    with pytest.raises(ValueError, match="multiple of 4"):
        bn(torch.randn(6, 3, 2, 2))


def test_config_checks_bn_batch():
    assert TrainConfig.from_dict({"train": {"batch_size": 64, "bn_batch": 16}}).train.bn_batch == 16
    with pytest.raises(ConfigError, match=r"train.bn_batch must be null or an integer >= 2 that divides "
                                          r"train.batch_size \(64\), got 24"):
        TrainConfig.from_dict({"train": {"batch_size": 64, "bn_batch": 24}})
    with pytest.raises(ConfigError, match="train.bn_batch"):
        TrainConfig.from_dict({"train": {"batch_size": 64, "bn_batch": 1}})
    with pytest.raises(ValueError, match="at least 2 rows"):
        set_ghost_batch(torch.nn.Sequential(SegmentedBatchNorm2d(2)), 1)


@pytest.mark.parametrize("model", ["cnn_tiny", "wrn26_2_shakeshake"])
def test_runner_sets_ghost_batches_on_the_student_only(model):
    cfg = TrainConfig.from_dict({"model": model, "train": {"batch_size": 8, "bn_batch": 4, "device": "cpu"},
                                 "mix": {"name": "cowmix"}})
    torch.manual_seed(0)
    student = create_model(cfg.model, 10)
    teacher = make_teacher(student)
    StepRunner(cfg, student, teacher, make_optimizer(student, cfg.optim, 8), torch.device("cpu"), bf16=False)
    assert {m.ghost for m in segmentable(student)} == {4}
    assert {m.ghost for m in segmentable(teacher)} == {None}
    # in training, a student batch of two groups is normalised per group: the output differs from whole-batch
    x = torch.randn(8, 3, 32, 32)
    whole = copy.deepcopy(student)
    set_ghost_batch(whole, None)
    torch.manual_seed(1)
    a = student(x)
    torch.manual_seed(1)
    b = whole(x)
    assert not torch.allclose(a, b, atol=1e-3)


def test_ghost_batches_are_not_paired(monkeypatch):
    """Ghost batch norm runs each layer through the one-pass function on its own, never the paired kernels."""
    from trainables.models.segmented_bn import pairs_in_one_pass
    monkeypatch.setattr(SegmentedBatchNorm2d, "one_pass_eager", True)
    a, b = _layer(None), _layer(None)
    y = torch.randn(8, 6, 4, 4)
    with batch_segments([a, b], ((4, True), (4, True))):
        assert pairs_in_one_pass(a, b, y)
        a.ghost = b.ghost = 2
        assert not pairs_in_one_pass(a, b, y)
