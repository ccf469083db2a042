import math

import pytest
import torch

from trainables.ssl.masks import beta_sample, blur_radius, box_masks, cow_masks, gaussian_matrices


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def spatial_autocorrelation(masks: torch.Tensor, shift: int = 2) -> float:
    """Correlation between a pixel and its neighbour `shift` pixels to the right, over all masks."""
    m = masks[:, 0].float()
    a, b = m[:, :, :-shift].flatten(), m[:, :, shift:].flatten()
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).mean() / (a.std(correction=0) * b.std(correction=0)))


@pytest.mark.parametrize("p", [0.2, 0.5, 0.8])
def test_cow_mask_mean_matches_fixed_p(p):
    masks = cow_masks(512, (32, 32), (4.0, 16.0), (p, p), gen())
    assert masks.shape == (512, 1, 32, 32)
    assert set(masks.unique().tolist()) <= {0.0, 1.0}
    assert abs(masks.mean().item() - p) < 0.03
    # per-mask deviation is small on average, as the reference observes (~0.04 on 32x32)
    assert (masks.mean((1, 2, 3)) - p).abs().mean().item() < 0.07


def test_cow_mask_mean_over_p_range():
    masks = cow_masks(1024, (32, 32), (4.0, 16.0), (0.2, 0.8), gen(1))
    assert abs(masks.mean().item() - 0.5) < 0.03
    per_mask = masks.mean((1, 2, 3))
    assert per_mask.min() < 0.3 and per_mask.max() > 0.7


def test_larger_sigma_gives_smoother_masks():
    small = cow_masks(256, (32, 32), (1.0, 1.0), (0.5, 0.5), gen(2))
    medium = cow_masks(256, (32, 32), (4.0, 4.0), (0.5, 0.5), gen(2))
    large = cow_masks(256, (32, 32), (16.0, 16.0), (0.5, 0.5), gen(2))
    r_small, r_medium, r_large = (spatial_autocorrelation(m) for m in (small, medium, large))
    assert r_small < r_medium < r_large
    assert r_large > 0.8 and r_small < 0.5


def test_cow_masks_seeded():
    a = cow_masks(8, (32, 32), (4.0, 16.0), (0.2, 0.8), gen(5))
    b = cow_masks(8, (32, 32), (4.0, 16.0), (0.2, 0.8), gen(5))
    c = cow_masks(8, (32, 32), (4.0, 16.0), (0.2, 0.8), gen(6))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_gaussian_matrix_is_zero_padded_filter():
    sig = torch.tensor([2.0])
    g = gaussian_matrices(sig, 8, blur_radius(2.0))[0]
    x = torch.arange(8.0)
    expected = torch.exp(-(x[:, None] - x[None, :]) ** 2 / 8.0) / (2.0 * math.sqrt(2 * math.pi))
    assert torch.allclose(g, expected)
    # kernel radius comes from max_sigma: 2 * round(3 * 0.5) + 1 = 5 taps each side
    g_small = gaussian_matrices(torch.tensor([3.0]), 16, blur_radius(0.5))[0]
    assert g_small[0, 5] > 0 and g_small[0, 6] == 0


@pytest.mark.parametrize("mode", ["fixed", "random_area", "random_size"])
def test_box_masks_inside_bounds(mode):
    masks = box_masks(500, (32, 24), mode, 0.25, True, gen(3))
    assert masks.shape == (500, 1, 32, 24)
    inside = masks[:, 0] == 0
    for m in inside[:50]:
        rows = m.any(1).nonzero().flatten()
        cols = m.any(0).nonzero().flatten()
        if len(rows):
            # a single contiguous rectangle
            assert m[rows.min():rows.max() + 1, cols.min():cols.max() + 1].all()
            assert m.sum() == (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
    if mode == "fixed":
        assert abs(inside.float().mean().item() - 0.25) < 0.03
    if mode == "random_area":
        assert abs(inside.float().mean().item() - 0.5) < 0.05


def test_box_mask_rejects_unknown_mode():
    with pytest.raises(ValueError, match="scale_mode"):
        box_masks(2, (8, 8), "huge", 0.25, True, gen())


def test_beta_sample_moments():
    for a in (0.1, 1.0, 2.0):
        s = beta_sample(a, 20000, gen(4))
        assert s.min() >= 0 and s.max() <= 1
        assert abs(s.mean().item() - 0.5) < 0.02
        assert abs(s.var().item() - 1 / (4 * (2 * a + 1))) < 0.01


def _cow_masks_by_the_formula(n, size, sigma_range, prop_range, g):
    """Algorithm 1 written out, each blur matrix computed afresh: what cow_masks must give bit for bit."""
    h, w = size
    p = prop_range[0] + (prop_range[1] - prop_range[0]) * torch.rand(n, generator=g)
    lo, hi = math.log(sigma_range[0]), math.log(sigma_range[1])
    sigmas = (lo + (hi - lo) * torch.rand(n, generator=g)).exp()
    noise = torch.randn(n, h, w, generator=g)
    radius = 2 * round(3 * sigma_range[1]) + 1

    def blur(size):
        pos = torch.arange(size, dtype=torch.float32)
        offset = pos[:, None] - pos[None, :]
        s = sigmas[:, None, None]
        return torch.exp(-offset**2 / (2 * s * s)) / (s * math.sqrt(2 * math.pi)) * (offset.abs() <= radius)

    smooth = blur(h) @ noise @ blur(w).transpose(1, 2)
    threshold = smooth.mean(dim=(1, 2)) + math.sqrt(2.0) * torch.erfinv(2 * p - 1) * smooth.std(dim=(1, 2), correction=0)
    return (smooth <= threshold[:, None, None]).float().unsqueeze(1)


@pytest.mark.parametrize("size", [(32, 32), (24, 40)])
def test_cow_masks_are_the_formula_bit_for_bit(size):
    # a square mask's two blur matrices are one
    for call in range(2):
        got = cow_masks(16, size, (4.0, 16.0), (0.25, 0.75), gen(call))
        assert torch.equal(got, _cow_masks_by_the_formula(16, size, (4.0, 16.0), (0.25, 0.75), gen(call)))


def _box_masks_by_the_formula(n, size, scale_mode, scale, random_aspect, g):
    """The box masks written out with their draws in the reference's order: area, aspect, top, left."""
    h, w = size
    area = torch.full((n,), scale) if scale_mode == "fixed" else \
        torch.rand(n, generator=g) if scale_mode == "random_area" else torch.rand(n, generator=g) ** 2
    log_ar = (-1.0 + 2.0 * torch.rand(n, generator=g)) * torch.log(area.clamp_min(1e-8)) if random_aspect else None
    ar_sqrt = torch.exp(0.5 * log_ar) if random_aspect else torch.ones(n)
    box_h, box_w = h * area.sqrt() * ar_sqrt, w * area.sqrt() / ar_sqrt
    y0 = torch.rand(n, generator=g) * (h - box_h)
    x0 = torch.rand(n, generator=g) * (w - box_w)
    cy, cx = torch.arange(h) + 0.5, torch.arange(w) + 0.5
    in_y = (cy[None] >= y0[:, None]) & (cy[None] <= (y0 + box_h)[:, None])
    in_x = (cx[None] >= x0[:, None]) & (cx[None] <= (x0 + box_w)[:, None])
    return (~(in_y[:, :, None] & in_x[:, None, :])).float().unsqueeze(1)


@pytest.mark.parametrize("mode", ["fixed", "random_area", "random_size"])
@pytest.mark.parametrize("random_aspect", [True, False])
def test_box_masks_are_the_formula(mode, random_aspect):
    got = box_masks(64, (32, 24), mode, 0.3, random_aspect, gen(7))
    assert torch.equal(got, _box_masks_by_the_formula(64, (32, 24), mode, 0.3, random_aspect, gen(7)))


def _beta_by_the_formula(alpha, n, g):
    """Beta(alpha, alpha) as two Gamma samples, each drawing eight rounds of normals, then of uniforms, then the
    boost's uniforms (Marsaglia-Tsang on Gamma(alpha + 1))."""
    d = alpha + 2.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)

    def gamma():
        x, u = torch.randn(8, n, generator=g), torch.rand(8, n, generator=g)
        v = (1 + c * x) ** 3
        ok = (v > 0) & (torch.log(u.clamp_min(1e-12)) < 0.5 * x * x + d - d * v + d * torch.log(v.clamp_min(1e-12)))
        first = torch.argmax(ok.int(), dim=0)
        sample = torch.where(ok.any(0), (d * v).gather(0, first[None]).squeeze(0), torch.tensor(d))
        return sample * torch.rand(n, generator=g).clamp_min(1e-12) ** (1.0 / alpha)

    a, b = gamma(), gamma()
    return a / (a + b).clamp_min(1e-30)


@pytest.mark.parametrize("alpha", [0.1, 1.0, 2.0])
def test_beta_sample_is_the_formula(alpha):
    # to rounding: a number as a power's exponent takes other code paths than a tensor (2.0: 1 ulp apart)
    torch.testing.assert_close(beta_sample(alpha, 256, gen(9)), _beta_by_the_formula(alpha, 256, gen(9)),
                               rtol=1e-6, atol=1e-7)
