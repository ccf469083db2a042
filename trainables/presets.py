"""Shipped configs (``trainables/configs/*.yaml``) and ``--set key=value`` overrides."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from trainables.config import TrainConfig, todays_key
from trainables.validation import ConfigError, set_dotted, unknown_name

CONFIG_DIR = Path(__file__).parent / "configs"
IMAGENET_PRESET = "imagenet_cowmix"   # what `cowtune final --datasets imagenet=DIR` starts from
_RANGE = re.compile(r"^\s*(-?[0-9.]+(?:e-?[0-9]+)?)\s*:\s*(-?[0-9.]+(?:e-?[0-9]+)?)\s*$")


def list_presets() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def read_config_file(name_or_path: str) -> dict[str, Any]:
    """A YAML file path, or the name of a shipped preset."""
    path = Path(name_or_path)
    if not path.exists():
        if "/" in name_or_path or name_or_path.endswith((".yaml", ".yml")):
            raise ConfigError(f"config file {name_or_path} does not exist")
        if name_or_path not in list_presets():
            raise unknown_name("config preset", name_or_path, list_presets())
        path = CONFIG_DIR / f"{name_or_path}.yaml"
    if path.is_dir():
        raise ConfigError(f"config file {name_or_path} is a folder: give a YAML file or a preset name")
    try:
        data = load_yaml(path.read_text())
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a YAML file (not UTF-8 text)") from None
    except (yaml.YAMLError, ValueError) as exc:
        raise ConfigError(f"{path} is not valid YAML: {yaml_problem(exc)}") from None
    if data is None:   # nothing but blanks and comments: every field would be its default (CIFAR-10's)
        raise ConfigError(f"empty config file {path}: write the fields to change (see `cowtune train fast --dry-run`)"
                          ", or name a preset")
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of config fields, got {type(data).__name__}")
    return data


def yaml_problem(exc: Exception) -> str:
    """A YAML parse error on one line: what is wrong and where (PyYAML's own message spans several lines)."""
    mark = getattr(exc, "problem_mark", None)
    what = ", ".join(p for p in (getattr(exc, "context", None), getattr(exc, "problem", None)) if p)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return (what or " ".join(str(exc).split())) + where


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a plain scalar with a colon stays text (YAML 1.1 reads 4:16:32 as the
    base-60 number 15392, and 4:16 in a file as 256, which no config field means) and a key twice is an error."""

    def resolve(self, kind, value, implicit):
        tag = super().resolve(kind, value, implicit)
        if kind is yaml.ScalarNode and implicit[0] and ":" in value and tag.endswith((":int", ":float")):
            return "tag:yaml.org,2002:str"
        return tag

    def construct_mapping(self, node, deep=False):
        """A key given twice is refused (PyYAML keeps the last silently)."""
        keys: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in keys:
                raise yaml.constructor.ConstructorError(None, None, f"found the key {key!r} twice",
                                                        key_node.start_mark)
            keys.add(key)
        return super().construct_mapping(node, deep)


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def parse_value(text: str) -> Any:
    """YAML scalars and lists; 'lo:hi' is a two-number range (YAML would read 4:16 as base 60)."""
    m = _RANGE.match(text)
    if m:
        return [float(m.group(1)), float(m.group(2))]
    value = load_yaml(text)
    if isinstance(value, str):
        try:
            return float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
        except ValueError:
            pass
    return value


def apply_overrides(d: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set takes key=value, got {item!r}")
        key, value = item.split("=", 1)
        try:
            parsed = parse_value(value)
        except (yaml.YAMLError, ValueError) as exc:
            raise ConfigError(f"--set {item!r}: the value does not parse as YAML or LO:HI: "
                              f"{yaml_problem(exc)}") from None
        # train.fast=false is the shorthand of train.fast.enabled, beside other train.fast settings given before or
        # after it; train.compile=... the spelling before 2026-12-03, read as today's over a written config too
        key = todays_key(key.strip(), switch=isinstance(parsed, bool))
        train = d.get("train")
        if key.startswith("train.fast.") and isinstance(train, dict) and isinstance(train.get("fast"), bool):
            train["fast"] = {"enabled": train["fast"]}   # a file's `fast: false`, then --set train.fast.X
        set_dotted(d, key, parsed)
    return d


def load_config(name_or_path: str, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    return TrainConfig.from_dict(apply_overrides(read_config_file(name_or_path), list(overrides)))
