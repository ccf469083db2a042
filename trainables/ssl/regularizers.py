"""The consistency regularizers of the paper, one small frozen dataclass each, in one registry.

"Milking CowMask for Semi-Supervised Image Classification", French, Oliver, Salimans,
arXiv:2003.12022. Two verbs (after the authors' ``masking/regularizers.py``):

* ``perturb(x, gen) -> x'`` for the erasure family (kind "perturb"): mean_teacher (identity),
  randerase (box erasure), cowout (CowMask erasure). Erased pixels get N(0, noise_std) noise in
  normalised image space, per pixel and channel.
* ``mix(x0, x1, gen) -> (x_mixed, blend)`` for the mixing family (kind "mix"): ict (Beta blend),
  cutmix (box), cowmix (CowMask). ``blend`` (N,) is the fraction taken from ``x1``.

Each verb is two halves: ``draw(x, gen)``, every random number it uses and, under their names, the
regularizer's own numbers (NamedTuples of floats: ``CowMaskNumbers``, ``ErasureNumbers``, ...), then
``perturb_drawn`` / ``mix_drawn``, the arithmetic on them with no generator. The fast path puts those numbers
on the device as 0-d tensors and compiles the second half; so that one compilation serves every trial, it
reads of ``self`` only what decides the shape of the computation (a box's scale mode), never a number's
value (whether a part is on at all, noise or apply_prob < 1, shows as which draws there are).

"supervised" is not a regularizer: it is a config with neither path.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from trainables.ssl.masks import (BOX_SCALE_MODES, beta_draws, beta_from, beta_numbers, box_mask_draws, box_masks_from,
                                  cow_mask_draws, cow_mask_numbers, cow_masks_from)
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

    def draw(self, x: torch.Tensor, gen: torch.Generator) -> dict[str, Any]:
        """The random numbers one call uses, for a batch like ``x``, and this regularizer's own numbers (each a
        NamedTuple of floats, under its own key)."""
        return {}

    def perturb_drawn(self, x: torch.Tensor, draws: dict[str, Any]) -> torch.Tensor:
        raise NotImplementedError

    def mix_drawn(self, x0: torch.Tensor, x1: torch.Tensor, draws: dict[str, Any]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def perturb(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        return self.perturb_drawn(x, self.draw(x, gen))

    def mix(self, x0: torch.Tensor, x1: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mix_drawn(x0, x1, self.draw(x0, gen))


def _check_range(name: str, rng: tuple[float, float], lo: float, hi: float | None) -> None:
    ok = lo <= rng[0] <= rng[1] and (hi is None or rng[1] <= hi)
    bound = f"{lo} <= low <= high" + (f" <= {hi}" if hi is not None else "")
    check(ok, name, f"satisfy {bound}", rng)


def _erase_draws(x: torch.Tensor, noise_std: float, apply_prob: float, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Erasure's draws after its mask's: which samples are erased at all (with apply_prob < 1), the fill noise."""
    draws = {}
    if apply_prob < 1.0:
        draws["apply"] = torch.rand(x.shape[0], 1, 1, 1, generator=gen, device=x.device)
    if noise_std > 0:
        draws["fill"] = torch.randn(x.shape, generator=gen, device=x.device, dtype=x.dtype)
    return draws


class ErasureNumbers(NamedTuple):
    """What erasure reads of its regularizer besides the mask: floats, or 0-d tensors."""
    noise_std: float | torch.Tensor    # std of the fill noise
    apply_prob: float | torch.Tensor   # per-sample probability of erasing at all


def _erase(x: torch.Tensor, keep: torch.Tensor, draws: dict[str, Any]) -> torch.Tensor:
    """x * keep + noise * (1 - keep); with apply_prob < 1 some samples keep everything."""
    numbers: ErasureNumbers = draws["erase"]
    if "apply" in draws:
        keep = torch.where(draws["apply"] < numbers.apply_prob, keep, torch.ones_like(keep))
    keep = keep.to(x.dtype)
    if "fill" in draws:
        return x * keep + draws["fill"] * numbers.noise_std * (1 - keep)
    return x * keep


class BoxNumbers(NamedTuple):
    scale: float | torch.Tensor   # the box's area fraction in the "fixed" scale mode


def _blend(x0: torch.Tensor, x1: torch.Tensor, take1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    take1 = take1.to(x0.dtype)
    return x0 + (x1 - x0) * take1, take1.mean(dim=(1, 2, 3))


@register("mean_teacher")
@dataclass(frozen=True, kw_only=True)
class MeanTeacher(Regularizer):
    """Standard-augmentation consistency: the student sees an independent augmentation."""
    kind: ClassVar[str] = "perturb"
    augment_twice: ClassVar[bool] = True

    def perturb_drawn(self, x, draws):
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

    def draw(self, x, gen):
        u_p, u_sigma, noise = cow_mask_draws(x.shape[0], x.shape[-2:], gen, x.device)
        return {"u_p": u_p, "u_sigma": u_sigma, "noise": noise, **_erase_draws(x, self.noise_std, self.apply_prob, gen),
                "mask": cow_mask_numbers(self.sigma_range, self.prop_range),
                "erase": ErasureNumbers(self.noise_std, self.apply_prob)}

    def perturb_drawn(self, x, draws):
        keep = cow_masks_from(draws["u_p"], draws["u_sigma"], draws["noise"], draws["mask"])
        return _erase(x, keep, draws)


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

    def draw(self, x, gen):
        boxes = box_mask_draws(x.shape[0], self.scale_mode, self.random_aspect, gen, x.device)
        return {**boxes, **_erase_draws(x, self.noise_std, self.apply_prob, gen), "box": BoxNumbers(self.scale),
                "erase": ErasureNumbers(self.noise_std, self.apply_prob)}

    def perturb_drawn(self, x, draws):
        keep = box_masks_from(draws, x.shape[-2:], self.scale_mode, draws["box"].scale)
        return _erase(x, keep, draws)


@register("ict")
@dataclass(frozen=True, kw_only=True)
class ICT(Regularizer):
    """Interpolation consistency: blend whole images with lambda ~ Beta(alpha, alpha) per sample."""
    kind: ClassVar[str] = "mix"
    alpha: float = 0.1

    def __post_init__(self):
        check(self.alpha > 0, "ict.alpha", "be > 0", self.alpha)

    def draw(self, x, gen):
        draws = beta_draws(x.shape[0], gen, x.device)
        return {**{f"beta{i}": d for i, d in enumerate(draws)}, "beta": beta_numbers(self.alpha)}

    def mix_drawn(self, x0, x1, draws):
        lam = beta_from(tuple(draws[f"beta{i}"] for i in range(6)), draws["beta"]).to(x0.dtype)
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

    def draw(self, x, gen):
        return {**box_mask_draws(x.shape[0], self.scale_mode, self.random_aspect, gen, x.device),
                "box": BoxNumbers(self.scale)}

    def mix_drawn(self, x0, x1, draws):
        return _blend(x0, x1, box_masks_from(draws, x0.shape[-2:], self.scale_mode, draws["box"].scale))


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

    def draw(self, x, gen):
        u_p, u_sigma, noise = cow_mask_draws(x.shape[0], x.shape[-2:], gen, x.device)
        return {"u_p": u_p, "u_sigma": u_sigma, "noise": noise, "mask": cow_mask_numbers(self.sigma_range, self.prop_range)}

    def mix_drawn(self, x0, x1, draws):
        return _blend(x0, x1, cow_masks_from(draws["u_p"], draws["u_sigma"], draws["noise"], draws["mask"]))


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
