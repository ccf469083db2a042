"""The student's inputs after the regularizers' draws (trainables.step.student_inputs): compiled once for
every trial's numbers (on the device, as the fast path passes them), the same as with the plain step's floats, and
the same as the regularizers' own verbs."""
import pytest
import torch
from torch._dynamo.testing import CompileCounter

from trainables.fast.device_numbers import draws_on_device, on_device as numbers_on_device
from trainables.ssl.regularizers import REGULARIZERS
from trainables.step import student_inputs

# Two settings each that differ in their numbers only (not in what decides the computation's shape)
NUMBERS = {
    "mean_teacher": ({}, {}),
    "cowout": ({"sigma_range": (4.0, 16.0), "prop_range": (0.25, 1.0), "noise_std": 1.0, "apply_prob": 0.5},
               {"sigma_range": (2.0, 6.0), "prop_range": (0.4, 0.6), "noise_std": 0.3, "apply_prob": 0.9}),
    "randerase": ({"scale_mode": "fixed", "scale": 0.25}, {"scale_mode": "fixed", "scale": 0.5, "noise_std": 2.0}),
    "ict": ({"alpha": 0.1}, {"alpha": 1.5}),
    "cutmix": ({"scale_mode": "fixed", "scale": 0.25}, {"scale_mode": "fixed", "scale": 0.6}),
    "cowmix": ({"sigma_range": (4.0, 16.0), "prop_range": (0.2, 0.8)},
               {"sigma_range": (1.0, 3.0), "prop_range": (0.5, 0.5)}),
}


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def call(fn, reg, x_sup, x1, x0, seed, stacked=False, on_device=False):
    """``fn`` on the regularizer's draws; ``on_device``: its numbers as 0-d tensors, as the fast path passes them."""
    g = gen(seed)
    draws = reg.draw(x1 if reg.kind == "perturb" else x0, g)
    if on_device:
        draws = draws_on_device(draws, x0.device)
    if reg.kind == "perturb":
        return fn(x_sup, x1, x0, reg, draws, None, None, stacked, False)
    return fn(x_sup, x1, x0, None, None, reg, draws, stacked, False)


def test_every_regularizer_has_two_settings_here():
    assert set(NUMBERS) == set(REGULARIZERS)


@pytest.mark.parametrize("name", sorted(REGULARIZERS))
def test_one_compilation_serves_other_numbers(name):
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(student_inputs, backend=counter, dynamic=False)
    x_sup, x1, x0 = (torch.randn(8, 3, 16, 16, generator=gen(s)) for s in (1, 2, 3))
    for settings in NUMBERS[name]:
        reg = REGULARIZERS[name](**settings)
        got, blend = call(compiled, reg, x_sup, x1, x0, 4, on_device=True)
        want, want_blend = call(student_inputs, reg, x_sup, x1, x0, 4)   # the plain step's: floats
        assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == len(want) == 2
        if reg.kind == "mix":
            assert torch.equal(blend, want_blend)
    assert counter.frame_count == 1


@pytest.mark.parametrize("name", sorted(REGULARIZERS))
def test_inputs_are_the_regularizers_verbs_in_the_references_order(name):
    reg = REGULARIZERS[name]()
    x_sup, x1, x0 = (torch.randn(8, 3, 16, 16, generator=gen(s)) for s in (1, 2, 3))
    (stacked,), blend = call(student_inputs, reg, x_sup, x1, x0, 5, stacked=True)
    if reg.kind == "perturb":
        expected = reg.perturb(x1, gen(5))
    else:
        expected, expected_blend = reg.mix(x0, torch.roll(x0, shifts=-1, dims=0), gen(5))
        assert torch.equal(blend, expected_blend)
    assert torch.equal(stacked, torch.cat([x_sup, expected]))


def test_channels_last_on_request():
    reg = REGULARIZERS["cowmix"]()
    x = torch.randn(4, 3, 8, 8)
    (out,), _ = student_inputs(x, x, x, None, None, reg, reg.draw(x, gen()), True, True)
    assert out.is_contiguous(memory_format=torch.channels_last) and out.shape == (8, 3, 8, 8)


def test_loss_terms_compile_once_for_every_trials_numbers():
    from trainables.config import TrainConfig
    from trainables.step import PathNumbers, loss_terms

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(loss_terms, backend=counter, dynamic=False)
    logits = [torch.randn(8, 10, generator=gen(s)) for s in (1, 2, 3)]
    teacher = torch.randn(8, 10, generator=gen(4)) * 3
    y, blend = torch.randint(0, 10, (8,), generator=gen(5)), torch.rand(8, generator=gen(6))
    for omega, thresh in ((30.0, 0.6), (5.0, 0.2), (12.0, -1.0)):
        cfg = TrainConfig.from_dict({"perturb": {"name": "cowout", "weight": omega / 10, "conf_thresh": thresh},
                                     "mix": {"name": "cowmix", "weight": omega, "conf_thresh": thresh}})
        # as the fast path passes them: 0-d views of one device tensor (trainables.fast.switch.FastStep)
        numbers = numbers_on_device(PathNumbers.of(cfg), torch.device("cpu"))
        grads = []
        for fn in (compiled, loss_terms):
            xs = [t.clone().requires_grad_() for t in logits]
            loss, stats = fn(xs, teacher, y, blend, cfg.perturb, cfg.mix, numbers)
            loss.backward()
            grads.append((loss.detach(), stats, [x.grad for x in xs]))
        (a, sa, ga), (b, sb, gb) = grads
        assert torch.equal(a, b) and all(torch.equal(sa[k], sb[k]) for k in sb) and len(sb) == 6
        torch.testing.assert_close(b, _loss_by_hand(logits, teacher, y, blend, omega / 10, omega, thresh))
        assert all(torch.equal(p, q) for p, q in zip(ga, gb))
        if thresh < 0:   # a threshold <= 0 lets every sample pass
            assert sb["train/conf_rate"].item() == 1.0 and sb["train/mix_conf_rate"].item() == 1.0
    assert counter.frame_count == 1


def _loss_by_hand(logits, teacher, y, blend, omega_perturb, omega_mix, thresh):
    """The step's loss written out with numbers (cowout with per-sample confidence, cowmix with the batch's
    pass rate and blended confidences; their defaults)."""
    p = torch.softmax(teacher, 1)
    lam = blend[:, None]
    p_partner = torch.roll(p, -1, 0)

    def passing(conf):
        return torch.ones_like(conf) if thresh <= 0 else (conf > thresh).float()

    conf_mix = p.max(1).values + (p_partner.max(1).values - p.max(1).values) * blend
    cons = ((torch.softmax(logits[1], 1) - p) ** 2).sum(1) * passing(p.max(1).values)
    mix = ((torch.softmax(logits[2], 1) - (p + (p_partner - p) * lam)) ** 2).sum(1) * passing(conf_mix).mean()
    return torch.nn.functional.cross_entropy(logits[0], y) + omega_perturb * cons.mean() + omega_mix * mix.mean()
