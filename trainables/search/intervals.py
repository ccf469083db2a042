"""Search-space domains that know how to become searcher parameters and back (plain Python).

A search space is a nested dict keyed like ``TrainConfig`` whose leaves are ``Float``, ``Choice``
or ``Interval``. Each domain maps to one or two independent searcher parameters (``params``),
turns sampled values into a config value (``decode``) and a config value into parameters
(``encode``, used to put the paper's settings first in the search).

``Interval(low, high, log, min_width)`` is one *range* value such as CowMask's sigma range. It is
searched as (width, offset) inside [low, high], so every sample is a valid, non-empty range:
``low <= lo < hi <= high`` and ``hi - lo >= min_width`` (with ``log=True``: ``hi / lo >= min_width``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Union

from trainables.validation import ConfigError, check, flatten, set_dotted

# A searcher parameter: ("float", low, high, log) or ("choice", (values...)).
ParamSpec = tuple


@dataclass(frozen=True)
class Float:
    low: float
    high: float
    log: bool = False

    def __post_init__(self):
        check(self.low < self.high, "Float", "have low < high", (self.low, self.high))
        check(not self.log or self.low > 0, "Float", "have low > 0 when log=True", self.low)

    def params(self, path: str) -> dict[str, ParamSpec]:
        return {path: ("float", self.low, self.high, self.log)}

    def decode(self, values: dict[str, Any], path: str) -> float:
        return float(values[path])

    def encode(self, value: Any, path: str) -> dict[str, Any]:
        check(isinstance(value, (int, float)) and self.low <= value <= self.high, path,
              f"lie in [{self.low}, {self.high}] to be a point of this search", value)
        return {path: float(value)}


@dataclass(frozen=True)
class Choice:
    values: tuple

    def __post_init__(self):
        check(len(self.values) >= 1, "Choice", "have at least one value", self.values)

    def params(self, path: str) -> dict[str, ParamSpec]:
        return {path: ("choice", tuple(self.values))}

    def decode(self, values: dict[str, Any], path: str) -> Any:
        return values[path]

    def encode(self, value: Any, path: str) -> dict[str, Any]:
        check(value in self.values, path, f"be one of {list(self.values)} to be a point of this search", value)
        return {path: value}


@dataclass(frozen=True)
class Interval:
    low: float
    high: float
    log: bool = False
    min_width: float = 0.0   # linear: hi - lo >= min_width (> 0); log: hi / lo >= min_width (> 1)

    def __post_init__(self):
        check(self.low < self.high, "Interval", "have low < high", (self.low, self.high))
        check(not self.log or self.low > 0, "Interval", "have low > 0 when log=True", self.low)
        floor = 1.0 if self.log else 0.0
        check(self.min_width > floor, "Interval.min_width", f"be > {floor:g} so a range is never empty",
              self.min_width)
        check(self._w(self.min_width) < self._span, "Interval.min_width", "be narrower than [low, high]",
              self.min_width)

    def _t(self, x: float) -> float:
        return math.log(x) if self.log else x

    def _w(self, width: float) -> float:
        return math.log(width) if self.log else width

    @property
    def _span(self) -> float:
        return self._t(self.high) - self._t(self.low)

    def params(self, path: str) -> dict[str, ParamSpec]:
        return {f"{path}:width": ("float", self._w(self.min_width), self._span, False),
                f"{path}:offset": ("float", 0.0, 1.0, False)}

    def decode(self, values: dict[str, Any], path: str) -> list[float]:
        w = min(max(float(values[f"{path}:width"]), self._w(self.min_width)), self._span)
        lo = self._t(self.low) + float(values[f"{path}:offset"]) * (self._span - w)
        hi = min(lo + w, self._t(self.high))
        return [math.exp(lo), math.exp(hi)] if self.log else [lo, hi]

    def encode(self, value: Any, path: str) -> dict[str, Any]:
        ok = isinstance(value, (list, tuple)) and len(value) == 2 and self.low <= value[0] < value[1] <= self.high
        check(ok, path, f"be a range inside [{self.low}, {self.high}] to be a point of this search", value)
        w = self._t(value[1]) - self._t(value[0])
        check(w >= self._w(self.min_width) - 1e-9, path, f"be at least min_width {self.min_width} wide", value)
        room = self._span - w
        offset = 0.0 if room <= 1e-12 else (self._t(value[0]) - self._t(self.low)) / room
        return {f"{path}:width": max(w, self._w(self.min_width)), f"{path}:offset": min(max(offset, 0.0), 1.0)}


Domain = Union[Float, Choice, Interval]


def leaves(space: dict[str, Any]) -> Iterator[tuple[str, Domain]]:
    """(dotted path, domain) for every leaf; raises on a leaf that is not a domain."""
    for path, dom in flatten(space).items():
        if not isinstance(dom, (Float, Choice, Interval)):
            raise ConfigError(f"search space entry {path} must be a Float, Choice or Interval, got {dom!r}")
        yield path, dom


def space_params(space: dict[str, Any]) -> dict[str, ParamSpec]:
    out: dict[str, ParamSpec] = {}
    for path, dom in leaves(space):
        out.update(dom.params(path))
    return out


def decode(space: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """Searcher parameters -> nested config overrides, e.g. {"mix": {"sigma_range": [4, 16]}}."""
    out: dict[str, Any] = {}
    for path, dom in leaves(space):
        set_dotted(out, path, dom.decode(values, path))
    return out


def encode(space: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """A full config dict (e.g. the paper's settings) -> searcher parameters of the same point."""
    flat = flatten(config)
    out: dict[str, Any] = {}
    for path, dom in leaves(space):
        check(path in flat, path, "exist in the base config (the search space names a missing field)", None)
        out.update(dom.encode(flat[path], path))
    return out
