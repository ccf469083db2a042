"""Tests for trainables/models/: registry, shapes, gradients, pinned sizes, shake-shake, SAME pad."""
from __future__ import annotations

import re

import pytest
import torch

from trainables.models import MODELS, count_parameters, create_model, list_models, register_model
from trainables.models.layers import BnFedConv2d, SameConv2d, same_pad
from trainables.models.segmented_bn import convert_batch_norm
from trainables.models.shakeshake import ShakeShakeBlock, shake_combine
from trainables.validation import ConfigError

SMALL = ["cnn_tiny", "wrn28_2", "wrn26_2_shakeshake", "resnet18"]  # cheap enough for backward
SKIP_FORWARD = {"resnet152"}  # 58M params; its definition is torchvision's, only the count is checked


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("name", [n for n in list_models() if n not in SKIP_FORWARD])
def test_forward_shape_and_finite(name):
    model = create_model(name, 10)
    x = torch.randn(2, 3, 32, 32)
    for train in (True, False):
        model.train(train)
        with torch.no_grad():
            out = model(x)
        assert out.shape == (2, 10)
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", SMALL)
def test_every_parameter_gets_a_gradient(name):
    model = create_model(name, 10).train()
    model(torch.randn(4, 3, 32, 32)).logsumexp(1).sum().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"no gradient for {pname}"
        assert torch.isfinite(p.grad).all(), f"non-finite gradient for {pname}"


def test_channels_last():
    model = create_model("wrn26_2_shakeshake", 10).to(memory_format=torch.channels_last).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = create_model("wrn26_2_shakeshake", 10)
        ref.load_state_dict(model.state_dict())
        torch.testing.assert_close(model(x.to(memory_format=torch.channels_last)), ref.eval()(x))


def test_cnn_tiny_small_input():
    assert create_model("cnn_tiny", 3)(torch.randn(2, 3, 8, 8)).shape == (2, 3)


@pytest.mark.parametrize("name,classes,expected", [
    # the reference's 26,953,898 and 26,988,548 less the 11,424 biases of convolutions that feed a batch norm
    ("wrn26_6_shakeshake", 10, 26_942_474),
    ("wrn26_6_shakeshake", 100, 26_977_124),
    ("wrn28_2", 10, 1_467_610),
    ("resnet50", 1000, 25_557_032),
    ("resnet152", 1000, 60_192_808),
])
def test_pinned_parameter_counts(name, classes, expected):
    assert count_parameters(create_model(name, classes)) == expected


def test_wrn28_2_is_the_standard_size():
    assert 1_400_000 < count_parameters(create_model("wrn28_2", 10)) < 1_550_000


# ----------------------------------------------------------------------------- shake-shake

def test_shake_combine_value_and_gradient():
    a = torch.randn(3, 4, 2, 2, requires_grad=True)
    b = torch.randn(3, 4, 2, 2, requires_grad=True)
    alpha = torch.tensor([0.1, 0.5, 0.9]).view(3, 1, 1, 1)
    beta = torch.tensor([0.7, 0.2, 0.4]).view(3, 1, 1, 1)
    out = shake_combine(a, b, alpha, beta)
    torch.testing.assert_close(out, alpha * a + (1 - alpha) * b)
    out.sum().backward()
    torch.testing.assert_close(a.grad, beta.expand_as(a))
    torch.testing.assert_close(b.grad, (1 - beta).expand_as(b))


def test_block_eval_is_deterministic_average():
    block = ShakeShakeBlock(8, 16, 2).eval()
    x = torch.randn(2, 8, 8, 8)
    with torch.no_grad():
        out1, out2 = block(x), block(x)
        expected = block.shortcut(x) + 0.5 * (block.branch_a(x) + block.branch_b(x))
    assert torch.equal(out1, out2)
    torch.testing.assert_close(out1, expected)


def test_block_train_gates_depend_on_rng():
    block = ShakeShakeBlock(8, 8, 1).train()
    x = torch.randn(4, 8, 8, 8)
    torch.manual_seed(1)
    out1 = block(x)
    torch.manual_seed(2)
    out2 = block(x)
    torch.manual_seed(1)
    out3 = block(x)
    assert not torch.allclose(out1, out2)
    torch.testing.assert_close(out1, out3)


def _outputs_and_grads(model, x, seed=1):
    torch.manual_seed(seed)   # the shake-shake gates
    y = model(x)
    y.square().sum().backward()
    return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def reference_layout(name="wrn26_2_shakeshake", classes=10):
    """A shake-shake model in the reference's layout (a bias on each convolution feeding a batch norm), its batch
    norms converted as ``create_model`` converts them."""
    return convert_batch_norm(MODELS[name](classes, bn_conv_bias=True))


def test_bias_free_model_matches_the_reference_layout():
    """The reference's convolutions feeding a batch norm have a bias: with the same weights, the bias-free model
    gives the same outputs and gradients in training, the biases' own gradient is zero up to rounding, and the
    reference's state dict loads into ours, biases (made nonzero here, as rounding leaves them after training)
    folded into the running means, so eval mode gives the same outputs too."""
    ref = reference_layout().double().train()
    ours = create_model("wrn26_2_shakeshake", 10).double().train()
    biased = {k for k, m in ref.named_modules() if type(m) is SameConv2d and m.bias is not None}
    assert len(biased) == 1 + len([m for m in ours.modules() if isinstance(m, BnFedConv2d)])   # + the stem
    assert all(ours.get_submodule(k).bias is None for k in biased if k != "stem")
    with torch.no_grad():
        for k in biased:
            ref.get_submodule(k).bias.normal_()
        for m in ref.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(), m.running_var.uniform_(0.5, 2.0)
    assert ours.load_state_dict(ref.state_dict()).missing_keys == []
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    ref.eval()
    ours.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-10, atol=1e-10)
    ref.train()
    ours.train()
    y_ref, g_ref = _outputs_and_grads(ref, x)
    y, g = _outputs_and_grads(ours, x)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    for n in g:
        torch.testing.assert_close(g[n], g_ref[n], rtol=1e-8, atol=1e-10, msg=n)
    dead = [n for n in g_ref if n not in g]
    assert len(dead) == len(biased) - 1 and all(n.endswith(".bias") for n in dead)
    assert max(g_ref[n].abs().max().item() for n in dead) < 1e-9 * max(v.abs().max().item() for v in g.values())


def test_plain_models_are_the_plain_blocks():
    """``create_model`` builds the plain modules; the fast path switches a built model's blocks
    (``trainables.fast.model_swaps``)."""
    model = create_model("wrn26_2_shakeshake", 10)
    assert {type(m) for m in model.blocks} == {ShakeShakeBlock}


def test_model_eval_is_deterministic():
    model = create_model("wrn26_2_shakeshake", 10).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(x), model(x))


# ----------------------------------------------------------------------------- SAME padding

def test_same_pad_puts_extra_row_bottom_right():
    x = torch.ones(1, 1, 4, 4)
    y = same_pad(x, kernel=3, stride=2)  # total pad 1 -> (0 top/left, 1 bottom/right)
    assert y.shape == (1, 1, 5, 5)
    assert torch.equal(y[..., :4, :4], x)
    assert y[..., 4, :].abs().sum() == 0 and y[..., :, 4].abs().sum() == 0
    # odd input: total pad 2, symmetric
    assert same_pad(torch.ones(1, 1, 5, 5), 3, 2).shape == (1, 1, 7, 7)


def test_stride2_conv_in_shakeshake_model_halves_32():
    model = create_model("wrn26_2_shakeshake", 10)
    convs = [m for m in model.modules() if isinstance(m, SameConv2d) and m.stride[0] == 2]
    assert convs and all(c.padding == (0, 0) for c in convs)
    assert convs[0](torch.randn(1, convs[0].in_channels, 32, 32)).shape[-2:] == (16, 16)


# ----------------------------------------------------------------------------- registry errors

# 'wrn28_3' is equally close to wrn28_2 and wrn28_8; either suggestion is right.
@pytest.mark.parametrize("typo,close", [("wrn28_3", "wrn28_[28]"), ("cnn_tiyn", "cnn_tiny")])
def test_unknown_model_suggests_close_match(typo, close):
    with pytest.raises(ConfigError) as exc:
        create_model(typo, 10)
    msg = str(exc.value)
    assert f"Unknown model '{typo}'" in msg
    assert all(n in msg for n in list_models())
    assert re.search(f"Did you mean '{close}'", msg)


def test_unknown_model_without_close_match_still_lists_names():
    with pytest.raises(ConfigError, match="Known: .*wrn28_2"):
        create_model("cowmix", 10)


def test_duplicate_registration_raises():
    with pytest.raises(ValueError, match="already registered"):
        register_model("cnn_tiny")
