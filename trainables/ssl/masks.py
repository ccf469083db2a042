"""CowMask and box masks, batched on the device with an explicit generator.

"Milking CowMask for Semi-Supervised Image Classification", French, Oliver, Salimans,
arXiv:2003.12022, Algorithm 1; semantics of the authors' implementation
(``../shared/reference/cowmask-reference.md`` sections 2.1 and 2.2).

Convention, stated once: a mask is a float tensor of 0/1 values of shape (N, 1, H, W), shared
over channels. For erasure, 1 keeps the pixel; for mixing, 1 takes the pixel from the partner.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

BOX_SCALE_MODES = ("fixed", "random_area", "random_size")


def gaussian_matrices(sigmas: torch.Tensor, size: int, radius: float | torch.Tensor) -> torch.Tensor:
    """Per-sample blur operators G[i, j] = N(i - j; sigma) for a zero-padded 1-D filter.

    The reference filters with a kernel of radius R = 2 * round(3 * max_sigma) + 1 (sized from the
    maximum sigma, not the sample's: ``blur_radius``) and 'SAME' zero padding; that filter is exactly
    this matrix, with taps beyond R set to 0. Weights are analytically normalised, not re-normalised.

    Args:
        sigmas: (N,) float scales in pixels.
    Returns:
        (N, size, size) float tensor.
    """
    pos = torch.arange(size, device=sigmas.device, dtype=sigmas.dtype)
    offset = pos[:, None] - pos[None, :]
    s = sigmas[:, None, None]
    g = torch.exp(-offset**2 / (2 * s * s)) / (s * math.sqrt(2 * math.pi))
    return g * (offset.abs() <= radius)


def blur_radius(max_sigma: float) -> int:
    return 2 * round(3 * max_sigma) + 1


def cow_mask_draws(n: int, size: tuple[int, int], gen: torch.Generator,
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The random part of ``n`` CowMasks, in the order drawn: U[0, 1) for p and for log sigma, (n,) each,
    and the (n, H, W) N(0, 1) noise."""
    device = torch.device(device)
    u_p = torch.rand(n, generator=gen, device=device)
    u_sigma = torch.rand(n, generator=gen, device=device)
    return u_p, u_sigma, torch.randn(n, *size, generator=gen, device=device)


class CowMaskNumbers(NamedTuple):
    """What ``cow_masks_from`` reads of the ranges: floats, or 0-d tensors (so that compiled code serves every
    trial's ranges: ``trainables.fast``)."""
    p_low: float | torch.Tensor
    p_span: float | torch.Tensor
    log_sigma_low: float | torch.Tensor
    log_sigma_span: float | torch.Tensor
    radius: float | torch.Tensor   # of the blur, from the largest sigma (``blur_radius``)


def cow_mask_numbers(sigma_range: tuple[float, float], prop_range: tuple[float, float]) -> CowMaskNumbers:
    lo, hi = math.log(sigma_range[0]), math.log(sigma_range[1])
    return CowMaskNumbers(prop_range[0], prop_range[1] - prop_range[0], lo, hi - lo, float(blur_radius(sigma_range[1])))


def cow_masks_from(u_p: torch.Tensor, u_sigma: torch.Tensor, noise: torch.Tensor,
                   numbers: CowMaskNumbers) -> torch.Tensor:
    """CowMasks from their draws (``cow_mask_draws``) and ``numbers`` (``cow_mask_numbers``).

    Per mask: p ~ U[p_lo, p_hi); sigma ~ logU[s_lo, s_hi]; smooth = G_H @ noise @ G_W^T;
    mask = smooth <= mean + sqrt(2) erfinv(2p - 1) * std (population std), so about a fraction p of
    the pixels are 1. Returns (n, 1, H, W) float32 0/1.
    """
    h, w = noise.shape[-2:]
    p = numbers.p_low + numbers.p_span * u_p
    sigmas = (numbers.log_sigma_low + numbers.log_sigma_span * u_sigma).exp()
    g_h = gaussian_matrices(sigmas, h, numbers.radius)                          # (n, H, H)
    g_w = g_h if w == h else gaussian_matrices(sigmas, w, numbers.radius)     # (n, W, W): the same if square
    smooth = g_h @ noise @ g_w.transpose(1, 2)                              # (n, H, W)
    mean = smooth.mean(dim=(1, 2))
    std = smooth.std(dim=(1, 2), correction=0)
    factor = math.sqrt(2.0) * torch.erfinv(2 * p - 1)                       # standard normal quantile of p
    threshold = mean + factor * std
    return (smooth <= threshold[:, None, None]).float().unsqueeze(1)


def cow_masks(n: int, size: tuple[int, int], sigma_range: tuple[float, float],
              prop_range: tuple[float, float], gen: torch.Generator,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """Draw ``n`` CowMasks: thresholded Gaussian-smoothed noise (``cow_masks_from``).

    Returns:
        (n, 1, H, W) float32 tensor of 0/1 values on ``device``.
    """
    return cow_masks_from(*cow_mask_draws(n, size, gen, device), cow_mask_numbers(sigma_range, prop_range))


def box_mask_draws(n: int, scale_mode: str, random_aspect: bool, gen: torch.Generator,
                   device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The random part of ``n`` box masks, U[0, 1) each (n,), in the order drawn: the area (unless the scale
    mode is fixed), the aspect ratio (if random), the top and left edges."""
    if scale_mode not in BOX_SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {BOX_SCALE_MODES}, got {scale_mode!r}")
    device = torch.device(device)
    names = (["area"] if scale_mode != "fixed" else []) + (["aspect"] if random_aspect else []) + ["top", "left"]
    return {name: torch.rand(n, generator=gen, device=device) for name in names}


def box_masks_from(draws: dict[str, torch.Tensor], size: tuple[int, int], scale_mode: str,
                   scale: float | torch.Tensor) -> torch.Tensor:
    """Box masks from their draws (``box_mask_draws``); ``scale``: the fixed mode's area, a float or a 0-d tensor.

    Area fraction a: ``fixed`` -> scale, ``random_area`` -> U(0, 1), ``random_size`` -> U(0, 1)^2.
    With a random aspect ratio, log(AR) ~ U(-1, 1) * log(a), so AR lies in [a, 1/a] and the box
    (H sqrt(a AR), W sqrt(a / AR)) always fits. A pixel is inside when its centre is.
    """
    h, w = size
    top = draws["top"]
    if scale_mode == "fixed":
        area = scale.expand(top.shape) if isinstance(scale, torch.Tensor) else torch.full_like(top, scale)
    else:
        area = draws["area"] if scale_mode == "random_area" else draws["area"] ** 2
    ar_sqrt = torch.exp(0.5 * ((-1.0 + 2.0 * draws["aspect"]) * torch.log(area.clamp_min(1e-8)))) \
        if "aspect" in draws else torch.ones_like(area)
    box_h = h * area.sqrt() * ar_sqrt
    box_w = w * area.sqrt() / ar_sqrt
    y0 = top * (h - box_h)
    x0 = draws["left"] * (w - box_w)
    cy = torch.arange(h, device=top.device) + 0.5
    cx = torch.arange(w, device=top.device) + 0.5
    in_y = (cy[None, :] >= y0[:, None]) & (cy[None, :] <= (y0 + box_h)[:, None])  # (n, H)
    in_x = (cx[None, :] >= x0[:, None]) & (cx[None, :] <= (x0 + box_w)[:, None])  # (n, W)
    inside = in_y[:, :, None] & in_x[:, None, :]
    return (~inside).float().unsqueeze(1)


def box_masks(n: int, size: tuple[int, int], scale_mode: str, scale: float, random_aspect: bool,
              gen: torch.Generator, device: torch.device | str = "cpu") -> torch.Tensor:
    """Draw ``n`` axis-aligned boxes that lie fully inside the image; 0 inside, 1 outside (``box_masks_from``).

    Returns:
        (n, 1, H, W) float32 tensor of 0/1 values on ``device``.
    """
    device = torch.device(device)
    draws = box_mask_draws(n, scale_mode, random_aspect, gen, device)
    return box_masks_from(draws, size, scale_mode, scale)


def beta_draws(n: int, gen: torch.Generator, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """The random part of ``n`` Beta samples, in the order drawn: for each of its two Gamma samples, (8, n)
    normals and (8, n) uniforms for eight proposal rounds, and (n,) uniforms for the boost."""
    device = torch.device(device)
    return tuple(draw for _ in range(2) for draw in (torch.randn(8, n, generator=gen, device=device),
                                                     torch.rand(8, n, generator=gen, device=device),
                                                     torch.rand(n, generator=gen, device=device)))


class BetaNumbers(NamedTuple):
    """What ``beta_from`` reads of alpha: Marsaglia-Tsang's d and c for Gamma(alpha + 1), and 1 / alpha (floats, or
    0-d tensors)."""
    d: float | torch.Tensor
    c: float | torch.Tensor
    inv_alpha: float | torch.Tensor


def beta_numbers(alpha: float) -> BetaNumbers:
    d = alpha + 1.0 - 1.0 / 3.0
    return BetaNumbers(d, 1.0 / math.sqrt(9.0 * d), 1.0 / alpha)


def beta_from(draws: tuple[torch.Tensor, ...], numbers: BetaNumbers) -> torch.Tensor:
    """Beta(alpha, alpha) samples from their draws (``beta_draws``) and ``numbers`` (``beta_numbers``).

    Gamma(a) by Marsaglia-Tsang on Gamma(a + 1) with the boost U^(1/a); eight vectorised
    proposal rounds (acceptance > 95% each), the first accepted one is used.
    """
    d, c, inv_alpha = numbers

    def gamma(x: torch.Tensor, u: torch.Tensor, u_boost: torch.Tensor) -> torch.Tensor:
        v = (1 + c * x) ** 3
        ok = (v > 0) & (torch.log(u.clamp_min(1e-12)) < 0.5 * x * x + d - d * v + d * torch.log(v.clamp_min(1e-12)))
        first = torch.argmax(ok.int(), dim=0)                          # first accepted round
        g = (d * v).gather(0, first[None]).squeeze(0)
        g = torch.where(ok.any(0), g, d)
        return g * u_boost.clamp_min(1e-12) ** exponent

    # pow with a Python number for exponent takes PyTorch's special cases (2: a square, 0.5: a square root) and
    # rounds otherwise than with a tensor: a 0-d tensor, as the fast path passes, gives one result either way
    exponent = inv_alpha if isinstance(inv_alpha, torch.Tensor) else \
        torch.tensor(inv_alpha, dtype=draws[2].dtype, device=draws[2].device)

    a, b = gamma(*draws[:3]), gamma(*draws[3:])
    return a / (a + b).clamp_min(1e-30)


def beta_sample(alpha: float, n: int, gen: torch.Generator, device: torch.device | str = "cpu") -> torch.Tensor:
    """Beta(alpha, alpha) samples from an explicit generator, without host synchronisation (``beta_from``)."""
    return beta_from(beta_draws(n, gen, device), beta_numbers(alpha))
