"""CowMask and box masks, batched on the device with an explicit generator.

"Milking CowMask for Semi-Supervised Image Classification", French, Oliver, Salimans,
arXiv:2003.12022, Algorithm 1; semantics of the authors' implementation
(``../shared/reference/cowmask-reference.md`` sections 2.1 and 2.2).

Convention, stated once: a mask is a float tensor of 0/1 values of shape (N, 1, H, W), shared
over channels. For erasure, 1 keeps the pixel; for mixing, 1 takes the pixel from the partner.
"""
from __future__ import annotations

import math

import torch

BOX_SCALE_MODES = ("fixed", "random_area", "random_size")
_OFFSETS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _uniform(n: int, lo: float, hi: float, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(n, generator=gen, device=device)


def gaussian_matrices(sigmas: torch.Tensor, size: int, max_sigma: float) -> torch.Tensor:
    """Per-sample blur operators G[i, j] = N(i - j; sigma) for a zero-padded 1-D filter.

    The reference filters with a kernel of radius R = 2 * round(3 * max_sigma) + 1 (sized from the
    maximum sigma, not the sample's) and 'SAME' zero padding; that filter is exactly this matrix,
    with taps beyond R set to 0. Weights are analytically normalised, not re-normalised.

    Args:
        sigmas: (N,) float scales in pixels.
    Returns:
        (N, size, size) float tensor.
    """
    radius = 2 * round(3 * max_sigma) + 1
    neg_square, within = _offsets(size, radius, sigmas.device, sigmas.dtype)
    s = sigmas[:, None, None]
    g = torch.exp(neg_square / (2 * s * s)) / (s * math.sqrt(2 * math.pi))
    return g * within


def _offsets(size: int, radius: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """-(i - j)**2 and |i - j| <= radius, (size, size) each: made once per (size, radius, device, dtype) and
    kept (six small kernels fewer in each training step), except while a CUDA graph captures, where a tensor
    made holds nothing until the graph replays."""
    key = (size, radius, device, dtype)
    if key in _OFFSETS:
        return _OFFSETS[key]
    pos = torch.arange(size, device=device, dtype=dtype)
    offset = pos[:, None] - pos[None, :]
    made = (-offset**2, offset.abs() <= radius)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _OFFSETS[key] = made
    return made


def cow_masks(n: int, size: tuple[int, int], sigma_range: tuple[float, float],
              prop_range: tuple[float, float], gen: torch.Generator,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """Draw ``n`` CowMasks: thresholded Gaussian-smoothed noise.

    Per mask: p ~ U[p_lo, p_hi); sigma ~ logU[s_lo, s_hi]; noise ~ N(0, 1) of shape (H, W);
    smooth = G_H @ noise @ G_W^T; mask = smooth <= mean + sqrt(2) erfinv(2p - 1) * std
    (population std), so about a fraction p of the pixels are 1.

    Returns:
        (n, 1, H, W) float32 tensor of 0/1 values on ``device``.
    """
    h, w = size
    device = torch.device(device)
    p = _uniform(n, prop_range[0], prop_range[1], gen, device)
    log_sigma = _uniform(n, math.log(sigma_range[0]), math.log(sigma_range[1]), gen, device)
    sigmas = log_sigma.exp()
    noise = torch.randn(n, h, w, generator=gen, device=device)
    g_h = gaussian_matrices(sigmas, h, sigma_range[1])                # (n, H, H)
    g_w = g_h if w == h else gaussian_matrices(sigmas, w, sigma_range[1])   # (n, W, W): the same if square
    smooth = g_h @ noise @ g_w.transpose(1, 2)                        # (n, H, W)
    mean = smooth.mean(dim=(1, 2))
    std = smooth.std(dim=(1, 2), correction=0)
    factor = math.sqrt(2.0) * torch.erfinv(2 * p - 1)                 # standard normal quantile of p
    threshold = mean + factor * std
    return (smooth <= threshold[:, None, None]).float().unsqueeze(1)


def box_masks(n: int, size: tuple[int, int], scale_mode: str, scale: float, random_aspect: bool,
              gen: torch.Generator, device: torch.device | str = "cpu") -> torch.Tensor:
    """Draw ``n`` axis-aligned boxes that lie fully inside the image; 0 inside, 1 outside.

    Area fraction a: ``fixed`` -> scale, ``random_area`` -> U(0, 1), ``random_size`` -> U(0, 1)^2.
    With a random aspect ratio, log(AR) ~ U(-1, 1) * log(a), so AR lies in [a, 1/a] and the box
    (H sqrt(a AR), W sqrt(a / AR)) always fits. A pixel is inside when its centre is.

    Returns:
        (n, 1, H, W) float32 tensor of 0/1 values on ``device``.
    """
    if scale_mode not in BOX_SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {BOX_SCALE_MODES}, got {scale_mode!r}")
    h, w = size
    device = torch.device(device)
    if scale_mode == "fixed":
        area = torch.full((n,), float(scale), device=device)
    elif scale_mode == "random_area":
        area = torch.rand(n, generator=gen, device=device)
    else:
        area = torch.rand(n, generator=gen, device=device) ** 2
    if random_aspect:
        log_ar = _uniform(n, -1.0, 1.0, gen, device) * torch.log(area.clamp_min(1e-8))
        ar_sqrt = torch.exp(0.5 * log_ar)
    else:
        ar_sqrt = torch.ones(n, device=device)
    box_h = h * area.sqrt() * ar_sqrt
    box_w = w * area.sqrt() / ar_sqrt
    y0 = torch.rand(n, generator=gen, device=device) * (h - box_h)
    x0 = torch.rand(n, generator=gen, device=device) * (w - box_w)
    cy = torch.arange(h, device=device) + 0.5
    cx = torch.arange(w, device=device) + 0.5
    in_y = (cy[None, :] >= y0[:, None]) & (cy[None, :] <= (y0 + box_h)[:, None])  # (n, H)
    in_x = (cx[None, :] >= x0[:, None]) & (cx[None, :] <= (x0 + box_w)[:, None])  # (n, W)
    inside = in_y[:, :, None] & in_x[:, None, :]
    return (~inside).float().unsqueeze(1)


def beta_sample(alpha: float, n: int, gen: torch.Generator, device: torch.device | str = "cpu") -> torch.Tensor:
    """Beta(alpha, alpha) samples from an explicit generator, without host synchronisation.

    Gamma(a) by Marsaglia-Tsang on Gamma(a + 1) with the boost U^(1/a); eight vectorised
    proposal rounds (acceptance > 95% each), the first accepted one is used.
    """
    device = torch.device(device)
    d = alpha + 1.0 - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)

    def gamma(m: int) -> torch.Tensor:
        rounds = 8
        x = torch.randn(rounds, m, generator=gen, device=device)
        u = torch.rand(rounds, m, generator=gen, device=device)
        v = (1 + c * x) ** 3
        ok = (v > 0) & (torch.log(u.clamp_min(1e-12)) < 0.5 * x * x + d - d * v + d * torch.log(v.clamp_min(1e-12)))
        first = torch.argmax(ok.int(), dim=0)                          # first accepted round
        g = (d * v).gather(0, first[None]).squeeze(0)
        g = torch.where(ok.any(0), g, torch.full_like(g, d))
        boost = torch.rand(m, generator=gen, device=device).clamp_min(1e-12) ** (1.0 / alpha)
        return g * boost

    a, b = gamma(n), gamma(n)
    return a / (a + b).clamp_min(1e-30)
