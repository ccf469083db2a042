import pytest
import torch

from trainables.ssl.regularizers import REGULARIZERS, regularizer_from_dict
from trainables.validation import ConfigError

PERTURB = [n for n, c in REGULARIZERS.items() if c.kind == "perturb"]
MIX = [n for n, c in REGULARIZERS.items() if c.kind == "mix"]


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_registry_holds_the_papers_methods():
    assert set(PERTURB) == {"mean_teacher", "randerase", "cowout"}
    assert set(MIX) == {"ict", "cutmix", "cowmix"}


@pytest.mark.parametrize("name", PERTURB)
def test_perturb_shapes_and_seeding(name):
    reg = REGULARIZERS[name]()
    x = torch.randn(16, 3, 32, 32)
    a, b = reg.perturb(x, gen(1)), reg.perturb(x, gen(1))
    assert a.shape == x.shape and torch.equal(a, b)


@pytest.mark.parametrize("name", MIX)
def test_mix_blend_in_unit_interval_and_mix_with_self_is_identity(name):
    reg = REGULARIZERS[name]()
    x0, x1 = torch.randn(16, 3, 32, 32), torch.randn(16, 3, 32, 32)
    mixed, blend = reg.mix(x0, x1, gen(2))
    assert mixed.shape == x0.shape and blend.shape == (16,)
    assert (blend >= 0).all() and (blend <= 1).all()
    same, _ = reg.mix(x0, x0, gen(2))
    assert torch.allclose(same, x0)


@pytest.mark.parametrize("name", ["cutmix", "cowmix"])
def test_mask_mix_blend_is_fraction_of_partner_pixels(name):
    reg = REGULARIZERS[name]()
    x0, x1 = torch.zeros(32, 3, 32, 32), torch.ones(32, 3, 32, 32)
    mixed, blend = reg.mix(x0, x1, gen(3))
    assert torch.allclose(mixed.mean((1, 2, 3)), blend)
    assert set(mixed.unique().tolist()) <= {0.0, 1.0}


def test_cowout_keeps_fraction_p_and_fills_noise():
    reg = REGULARIZERS["cowout"](prop_range=(0.5, 0.5), noise_std=1.0)
    x = torch.full((64, 3, 32, 32), 7.0)
    out = reg.perturb(x, gen(4))
    kept = (out == 7.0).all(1).float().mean().item()
    assert abs(kept - 0.5) < 0.05
    erased = out[out != 7.0]
    assert abs(erased.std().item() - 1.0) < 0.05 and abs(erased.mean().item()) < 0.05
    zero_fill = REGULARIZERS["cowout"](noise_std=0.0).perturb(x, gen(4))
    assert set(zero_fill.unique().tolist()) <= {0.0, 7.0}


def test_apply_prob_zero_leaves_images_alone():
    x = torch.randn(8, 3, 32, 32)
    for name in ("cowout", "randerase"):
        assert torch.equal(REGULARIZERS[name](apply_prob=0.0).perturb(x, gen()), x)


def test_ict_uses_beta_blend():
    reg = REGULARIZERS["ict"](alpha=0.1)
    x0, x1 = torch.zeros(4096, 1, 1, 1), torch.ones(4096, 1, 1, 1)
    mixed, blend = reg.mix(x0, x1, gen(5))
    assert torch.allclose(mixed.flatten(), blend)
    assert ((blend < 0.05) | (blend > 0.95)).float().mean() > 0.6   # Beta(0.1, 0.1) is U-shaped


def test_from_dict_is_strict():
    reg = regularizer_from_dict({"name": "cowmix", "sigma_range": [2, 8]}, prefix="mix")
    assert reg.sigma_range == (2.0, 8.0)
    with pytest.raises(ConfigError, match="Did you mean 'cowmix'"):
        regularizer_from_dict({"name": "cowmx"}, prefix="mix")
    with pytest.raises(ConfigError, match="sigma_rang.*Did you mean 'sigma_range'"):
        regularizer_from_dict({"name": "cowmix", "sigma_rang": [2, 8]}, prefix="mix")
    with pytest.raises(ConfigError, match=r"mix.prop_range must satisfy 0.0 <= low <= high <= 1.0, got \(0.8, 0.2\)"):
        regularizer_from_dict({"name": "cowmix", "prop_range": [0.8, 0.2]}, prefix="mix")


@pytest.mark.parametrize("name", ["cowout", "randerase"])
def test_erasure_draws_its_mask_then_which_samples_then_the_fill(name):
    from trainables.ssl.masks import box_masks, cow_masks

    reg = REGULARIZERS[name](apply_prob=0.6, noise_std=0.5)
    x = torch.randn(16, 3, 32, 32, generator=gen(10))
    g = gen(11)
    keep = cow_masks(16, (32, 32), reg.sigma_range, reg.prop_range, g) if name == "cowout" else \
        box_masks(16, (32, 32), reg.scale_mode, reg.scale, reg.random_aspect, g)
    applied = torch.rand(16, 1, 1, 1, generator=g) < 0.6
    keep = torch.where(applied, keep, torch.ones_like(keep))
    fill = torch.randn(x.shape, generator=g) * 0.5
    assert torch.equal(reg.perturb(x, gen(11)), x * keep + fill * (1 - keep))
