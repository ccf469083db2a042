"""The optimiser update and teacher EMA in two parts (trainables.fast.split_update) give what one update gives."""
import copy

import torch
from torch import nn

from trainables.config import OptimConfig
from trainables.fast.split_update import sgd_part_, split_update
from trainables.models import create_model
from trainables.optim import make_optimizer
from trainables.ssl.ema import EmaPairs, ema_update_, make_teacher


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    student = create_model("wrn28_2", 10)
    return student, make_teacher(student), make_optimizer(student, OptimConfig(), 8)


def _backward(student: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    student.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(student(x), y).backward()


def test_the_parts_split_convolutions_from_the_rest():
    student, teacher, opt = _setup()
    early, late = split_update(opt, EmaPairs(teacher, student), student)
    convs = {id(m.weight) for m in student.modules() if isinstance(m, nn.Conv2d)}
    late_params = [p for _, ps in late.groups for p in ps]
    early_params = [p for _, ps in early.groups for p in ps]
    assert {id(p) for p in late_params} == convs and not convs & {id(p) for p in early_params}
    assert len(late_params) + len(early_params) == len(list(student.parameters()))
    # the EMA: conv weights late; every other float tensor (batch-norm statistics too) and the counters early
    assert {id(s) for s in late.pairs.student_float} == convs and not late.pairs.teacher_other
    assert len(early.pairs.student_float) + len(late.pairs.student_float) == len(EmaPairs(teacher, student).student_float)
    teacher_tensors = {id(t) for t in [*teacher.parameters(), *teacher.buffers()]}
    assert early.pairs.teacher_other and all(id(t) in teacher_tensors for t in early.pairs.teacher_float)
    assert all(t.shape == s.shape for t, s in zip(early.pairs.teacher_float, early.pairs.student_float))


def test_two_parts_update_bit_for_bit_as_one_from_the_first_step_on():
    """From fresh momentum buffers (the parts start theirs at zero, SGD copies the first gradient) and on."""
    student_a, teacher_a, opt_a = _setup()
    student_b, teacher_b, opt_b = copy.deepcopy((student_a, teacher_a, opt_a))
    pairs_a = EmaPairs(teacher_a, student_a)
    early, late = split_update(opt_b, EmaPairs(teacher_b, student_b), student_b)
    for step in range(3):
        _backward(student_a, step)
        _backward(student_b, step)
        opt_a.step()
        ema_update_(pairs_a, 0.9)
        for part in (early, late):
            sgd_part_(opt_b, part)
            ema_update_(part.pairs, 0.9)
        for (name, a), b in zip(teacher_a.state_dict().items(), teacher_b.state_dict().values()):
            assert torch.equal(a, b), f"step {step}: teacher {name}"
        for (name, a), b in zip(student_a.state_dict().items(), student_b.state_dict().values()):
            assert torch.equal(a, b), f"step {step}: student {name}"
    bufs_a = [opt_a.state[p]["momentum_buffer"] for p in student_a.parameters()]
    bufs_b = [opt_b.state[p]["momentum_buffer"] for p in student_b.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(bufs_a, bufs_b))
    assert opt_b.state_dict()["state"].keys() == opt_a.state_dict()["state"].keys()


def _update_both(setups, parts, step, lr=None):
    (student_a, _, opt_a, pairs_a), (student_b, _, opt_b, _) = setups
    for student in (student_a, student_b):
        _backward(student, step)
    if lr is not None:   # as a resumed run's schedule sets it (the step graph: a device tensor in each group)
        for opt in (opt_a, opt_b):
            for group in opt.param_groups:
                group["lr"] = lr
    opt_a.step()
    ema_update_(pairs_a, 0.9)
    for part in parts:
        sgd_part_(opt_b, part)
        ema_update_(part.pairs, 0.9)
    for a, b in zip(student_a.state_dict().values(), student_b.state_dict().values()):
        assert torch.equal(a, b)


def test_the_parts_follow_the_optimiser_after_a_checkpoint_is_loaded():
    """Loading an optimiser state replaces its group dicts; the parts read the groups the optimiser has now, so a
    resumed run's learning rate reaches them (they once kept the dicts of the runner's start: the base rate)."""
    student_a, teacher_a, opt_a = _setup()
    student_b, teacher_b, opt_b = copy.deepcopy((student_a, teacher_a, opt_a))
    parts = split_update(opt_b, EmaPairs(teacher_b, student_b), student_b)
    setups = [(student_a, teacher_a, opt_a, EmaPairs(teacher_a, student_a)), (student_b, teacher_b, opt_b, None)]
    _update_both(setups, parts, 0)
    saved = copy.deepcopy(opt_b.state_dict())
    opt_b.load_state_dict(saved)
    opt_a.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    _update_both(setups, parts, 1, lr=0.5)   # ten times the base rate: a stale group would not move as far
    before = [p.detach().clone() for p in student_b.parameters()]
    _update_both(setups, parts, 2, lr=0.0)   # no step at all, momentum or not
    assert all(torch.equal(a, b) for a, b in zip(before, student_b.parameters()))


def test_a_parameter_without_a_gradient_is_left_alone():
    student, teacher, opt = _setup()
    early, late = split_update(opt, EmaPairs(teacher, student), student)
    _backward(student, 0)
    frozen = student.fc.weight
    frozen.grad = None
    kept = frozen.detach().clone()
    for part in (early, late):
        sgd_part_(opt, part)
    assert torch.equal(frozen, kept) and "momentum_buffer" not in opt.state[frozen]
