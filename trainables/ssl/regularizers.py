"""The consistency regularizers of the paper, one small frozen dataclass each, in one registry.

"Milking CowMask for Semi-Supervised Image Classification", French, Oliver, Salimans,
arXiv:2003.12022. Two verbs (after the authors' ``masking/regularizers.py``):

* ``perturb(x, gen) -> x'`` for the erasure family (kind "perturb"): mean_teacher (identity),
  randerase (box erasure), cowout (CowMask erasure). Erased pixels get N(0, noise_std) noise in
  normalised image space, per pixel and channel.
* ``mix(x0, x1, gen) -> (x_mixed, blend)`` for the mixing family (kind "mix"): ict (Beta blend),
  cutmix (box), cowmix (CowMask). ``blend`` (N,) is the fraction taken from ``x1``.

"supervised" is not a regularizer: it is a config with neither path.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from trainables.ssl.masks import BOX_SCALE_MODES, beta_sample, box_masks, cow_masks
from trainables.validation import ConfigError, build_dataclass, check, dataclass_to_dict, unknown_name

REGULARIZERS: dict[str, type["Regularizer"]] = {}


def register(name: str):
    def deco(cls: type) -> type:
        if name in REGULARIZERS:
            raise ValueError(f"regularizer '{name}' is registered twice")
        cls.name = name
        REGULARIZERS[name] = cls
        return cls
    return deco


@dataclass(frozen=True, kw_only=True)
class Regularizer:
    name: ClassVar[str] = ""
    kind: ClassVar[str] = ""          # "perturb" or "mix"
    augment_twice: ClassVar[bool] = False

    def perturb(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        raise NotImplementedError

    def mix(self, x0: torch.Tensor, x1: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


def _check_range(name: str, rng: tuple[float, float], lo: float, hi: float | None) -> None:
    ok = lo <= rng[0] <= rng[1] and (hi is None or rng[1] <= hi)
    bound = f"{lo} <= low <= high" + (f" <= {hi}" if hi is not None else "")
    check(ok, name, f"satisfy {bound}", rng)


def _erase(x: torch.Tensor, keep: torch.Tensor, noise_std: float, apply_prob: float,
           gen: torch.Generator) -> torch.Tensor:
    """x * keep + noise * (1 - keep); with apply_prob < 1 some samples keep everything."""
    if apply_prob < 1.0:
        applied = torch.rand(x.shape[0], 1, 1, 1, generator=gen, device=x.device) < apply_prob
        keep = torch.where(applied, keep, torch.ones_like(keep))
    keep = keep.to(x.dtype)
    if noise_std > 0:
        noise = torch.randn(x.shape, generator=gen, device=x.device, dtype=x.dtype) * noise_std
        return x * keep + noise * (1 - keep)
    return x * keep


def _blend(x0: torch.Tensor, x1: torch.Tensor, take1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    take1 = take1.to(x0.dtype)
    return x0 + (x1 - x0) * take1, take1.mean(dim=(1, 2, 3))


@register("mean_teacher")
@dataclass(frozen=True, kw_only=True)
class MeanTeacher(Regularizer):
    """Standard-augmentation consistency: the student sees an independent augmentation."""
    kind: ClassVar[str] = "perturb"
    augment_twice: ClassVar[bool] = True

    def perturb(self, x, gen):
        return x


@register("cowout")
@dataclass(frozen=True, kw_only=True)
class CowOut(Regularizer):
    """CowMask erasure; p is the fraction of pixels KEPT (paper: 0.25 to 1)."""
    kind: ClassVar[str] = "perturb"
    sigma_range: tuple[float, float] = (4.0, 16.0)   # pixels, log-uniform
    prop_range: tuple[float, float] = (0.25, 1.0)    # fraction kept
    noise_std: float = 1.0                           # std of the fill noise; 0 fills with 0 (the mean)
    apply_prob: float = 1.0                          # per-sample probability of erasing at all

    def __post_init__(self):
        _check_range("cowout.sigma_range", self.sigma_range, 1e-3, None)
        _check_range("cowout.prop_range", self.prop_range, 0.0, 1.0)
        check(self.noise_std >= 0, "cowout.noise_std", "be >= 0", self.noise_std)
        check(0 <= self.apply_prob <= 1, "cowout.apply_prob", "be in [0, 1]", self.apply_prob)

    def perturb(self, x, gen):
        keep = cow_masks(x.shape[0], x.shape[-2:], self.sigma_range, self.prop_range, gen, x.device)
        return _erase(x, keep, self.noise_std, self.apply_prob, gen)


@register("randerase")
@dataclass(frozen=True, kw_only=True)
class RandErase(Regularizer):
    """Box erasure filled with noise (RandErase); boxes lie fully inside the image."""
    kind: ClassVar[str] = "perturb"
    scale_mode: str = "random_size"                  # fixed | random_area | random_size
    scale: float = 0.25                              # box area fraction for "fixed"
    random_aspect: bool = True
    noise_std: float = 1.0
    apply_prob: float = 1.0

    def __post_init__(self):
        check(self.scale_mode in BOX_SCALE_MODES, "randerase.scale_mode", f"be one of {BOX_SCALE_MODES}",
              self.scale_mode)
        check(0 <= self.scale <= 1, "randerase.scale", "be in [0, 1]", self.scale)
        check(self.noise_std >= 0, "randerase.noise_std", "be >= 0", self.noise_std)
        check(0 <= self.apply_prob <= 1, "randerase.apply_prob", "be in [0, 1]", self.apply_prob)

    def perturb(self, x, gen):
        keep = box_masks(x.shape[0], x.shape[-2:], self.scale_mode, self.scale, self.random_aspect, gen, x.device)
        return _erase(x, keep, self.noise_std, self.apply_prob, gen)


@register("ict")
@dataclass(frozen=True, kw_only=True)
class ICT(Regularizer):
    """Interpolation consistency: blend whole images with lambda ~ Beta(alpha, alpha) per sample."""
    kind: ClassVar[str] = "mix"
    alpha: float = 0.1

    def __post_init__(self):
        check(self.alpha > 0, "ict.alpha", "be > 0", self.alpha)

    def mix(self, x0, x1, gen):
        lam = beta_sample(self.alpha, x0.shape[0], gen, x0.device).to(x0.dtype)
        return x0 + (x1 - x0) * lam[:, None, None, None], lam


@register("cutmix")
@dataclass(frozen=True, kw_only=True)
class CutMix(Regularizer):
    """Box mixing: the box comes from x0, the rest from x1; blend = fraction outside the box."""
    kind: ClassVar[str] = "mix"
    scale_mode: str = "random_area"
    scale: float = 0.25
    random_aspect: bool = True

    def __post_init__(self):
        check(self.scale_mode in BOX_SCALE_MODES, "cutmix.scale_mode", f"be one of {BOX_SCALE_MODES}",
              self.scale_mode)
        check(0 <= self.scale <= 1, "cutmix.scale", "be in [0, 1]", self.scale)

    def mix(self, x0, x1, gen):
        take1 = box_masks(x0.shape[0], x0.shape[-2:], self.scale_mode, self.scale, self.random_aspect, gen, x0.device)
        return _blend(x0, x1, take1)


@register("cowmix")
@dataclass(frozen=True, kw_only=True)
class CowMix(Regularizer):
    """CowMask mixing; p is the fraction of pixels taken from the partner (paper: 0.2 to 0.8)."""
    kind: ClassVar[str] = "mix"
    sigma_range: tuple[float, float] = (4.0, 16.0)
    prop_range: tuple[float, float] = (0.2, 0.8)

    def __post_init__(self):
        _check_range("cowmix.sigma_range", self.sigma_range, 1e-3, None)
        _check_range("cowmix.prop_range", self.prop_range, 0.0, 1.0)

    def mix(self, x0, x1, gen):
        take1 = cow_masks(x0.shape[0], x0.shape[-2:], self.sigma_range, self.prop_range, gen, x0.device)
        return _blend(x0, x1, take1)


def regularizer_from_dict(d: dict[str, Any], prefix: str = "regularizer",
                          extra_allowed: list[str] | tuple[str, ...] = ()) -> Regularizer:
    """Build a registered regularizer from {'name': ..., <its fields>}; strict about keys."""
    d = dict(d)
    name = d.pop("name", None)
    if name not in REGULARIZERS:
        raise unknown_name(f"regularizer in {prefix}.name", name, REGULARIZERS)
    cls = REGULARIZERS[name]
    fields = [f.name for f in dataclasses.fields(cls)]
    for key in d:
        if key not in fields:
            raise unknown_name(f"key in {prefix} (regularizer '{name}')", key, [*fields, *extra_allowed, "name"])
    try:
        return build_dataclass(cls, d, prefix=f"{prefix}.")
    except ConfigError as exc:
        raise ConfigError(str(exc).replace(f"{name}.", f"{prefix}.", 1)) from None


def regularizer_to_dict(reg: Regularizer) -> dict[str, Any]:
    return {"name": reg.name, **dataclass_to_dict(reg)}
