"""Strict conversion of plain data into typed dataclasses, with errors that name the field.

Two error templates, used everywhere: "<field> must <rule>, got <value>" for values and
"Unknown <what> 'x'. Known: a, b. Did you mean 'y'?" for names.
"""
from __future__ import annotations

import contextlib
import errno
import dataclasses
import math
import os
import tempfile
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Iterable


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names the field."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, say); the last one on disk is intact."""


class TrainingDiverged(RuntimeError):
    """A training loss became NaN or infinite; the run stopped, its last checkpoint kept."""


class RunOutOfMemory(RuntimeError):
    """The device ran out of memory in a step or an evaluation; the run stopped, its last checkpoint kept."""


# What a field's type alone does not say, told when a value of another type is given for it
TYPE_NOTES = {"data.n_labeled": "-1 means all"}


def check(ok: bool, name: str, rule: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{name} must {rule}, got {value!r}")


def _check_type(ok: bool, name: str, rule: str, value: Any) -> None:
    check(ok, name, f"{rule} ({TYPE_NOTES[name]})" if name in TYPE_NOTES else rule, value)


def unknown_name(what: str, name: str, known: Iterable[str]) -> ConfigError:
    known = sorted(known)
    close = difflib.get_close_matches(str(name), known, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"Unknown {what} '{name}'. Known: {', '.join(known)}.{hint}")


def _convert(value: Any, tp: Any, name: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            check(type(None) in args, name, "not be null", value)
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], name)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return build_dataclass(tp, value, prefix=f"{name}.")
    if origin is tuple:
        args = typing.get_args(tp)
        _check_type(isinstance(value, (list, tuple)), name,
                    "be a list of 2 numbers (LO:HI in --set)" if args == (float, float) else "be a list", value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{name}[{i}]") for i, v in enumerate(value))
        check(len(value) == len(args), name, f"have {len(args)} items", value)
        return tuple(_convert(v, a, f"{name}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        _check_type(isinstance(value, bool), name, "be true or false", value)
        return value
    if tp is int:
        _check_type(isinstance(value, int) and not isinstance(value, bool), name, "be an integer", value)
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        _check_type(isinstance(value, (int, float)) and not isinstance(value, bool), name, "be a number", value)
        check(math.isfinite(value), name, "be a finite number", value)   # an infinite rate or weight trains on NaNs
        return float(value)
    if tp is str:
        _check_type(isinstance(value, str), name, "be a string", value)
        return value
    raise TypeError(f"unsupported field type {tp!r} for {name}")


def build_dataclass(cls: type, d: Any, prefix: str = "", skip: Iterable[str] = (),
                    extra: dict[str, Any] | None = None) -> Any:
    """Instantiate dataclass ``cls`` from mapping ``d``; every key must be a field."""
    where = prefix.rstrip(".") or "config"
    if not isinstance(d, dict):
        raise ConfigError(f"{where} must be a mapping, got {d!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name not in skip and f.init]
    kwargs = dict(extra or {})
    for key, value in d.items():
        if key not in names:
            err = unknown_name(f"key in {where}", key, names)
            raise ConfigError(str(err))
        kwargs[key] = _convert(value, hints[key], f"{prefix}{key}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{where}: {exc}") from None


def dataclass_to_dict(obj: Any, skip: Iterable[str] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if f.name in skip:
            continue
        out[f.name] = _plain(getattr(obj, f.name))
    return out


def _plain(v: Any) -> Any:
    if dataclasses.is_dataclass(v):
        return dataclass_to_dict(v)
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    return v


def set_dotted(d: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``a.b.c = value`` in a nested dict, creating mappings on the way."""
    parts = dotted.split(".")
    node = d
    for p in parts[:-1]:
        if node.get(p) is None:
            node[p] = {}
        check(isinstance(node[p], dict), ".".join(parts[: parts.index(p) + 1]), "be a mapping to set "
              f"'{dotted}'", node[p])
        node = node[p]
    node[parts[-1]] = value


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}; lists stay values."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def writable_folder(path: str | os.PathLike, field: str, create: bool = True) -> Path:
    """``path`` as a folder this process can write files into, checked before any compute (made if missing, unless
    ``create`` is off: then the nearest folder that exists must be writable); raises ConfigError naming ``field``
    when it is a file, lies under one, or cannot be written (a read-only mount, say)."""
    p = Path(path).expanduser()
    blocker = next((a for a in (p, *p.parents) if a.exists() and not a.is_dir()), None)
    if blocker is not None:
        where = "is a file" if blocker == p else f"lies under the file {blocker}"
        raise ConfigError(f"{field} {path} {where}: give a folder")
    if not create and not p.exists():
        nearest = next(a for a in p.absolute().parents if a.exists())
        if not os.access(nearest, os.W_OK | os.X_OK):
            ro = " (a read-only file system)" if os.statvfs(nearest).f_flag & os.ST_RDONLY else ""
            raise ConfigError(f"{field} {path} cannot be made: {nearest} is not writable{ro}")
        made = p.absolute().relative_to(nearest).parts   # made and removed again: access() is not the whole answer
        try:                                              # (a read-only mount, /proc; for root, any folder)
            p.mkdir(parents=True)
            _probe(p)
        except OSError as exc:
            raise ConfigError(f"{field} {path} cannot be made ({exc.strerror or exc})") from None
        finally:
            for i in range(len(made), 0, -1):
                with contextlib.suppress(OSError):
                    (nearest / Path(*made[:i])).rmdir()
        return p
    try:
        p.mkdir(parents=True, exist_ok=True)
        _probe(p)
    except OSError as exc:
        raise ConfigError(f"{field} {path} cannot be written ({exc.strerror or exc})") from None
    return p


PROBE_BYTES = 64 * 1024   # written and synced: an empty file alone fits on a full disk (it takes no data block)


def _probe(folder: Path) -> None:
    """Write PROBE_BYTES into ``folder`` and remove them; raises the OSError (ENOSPC on a full disk, EROFS...)."""
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".cowtune-write-check-") as f:
        f.write(b"\0" * PROBE_BYTES)
        f.flush()
        os.fsync(f.fileno())


def disk_full(folder: str | os.PathLike) -> str | None:
    """The kernel's reason ("No space left on device", a quota) when ``folder`` cannot take PROBE_BYTES more, else
    None: what a job that failed while writing there asks before it says why."""
    try:
        _probe(Path(folder))
    except OSError as exc:
        return exc.strerror if exc.errno in (errno.ENOSPC, errno.EDQUOT) else None
    return None


def writable_file(path: str | os.PathLike, field: str) -> Path:
    """``path`` as a file this process can create or replace (its folder made if missing); ConfigError naming
    ``field`` otherwise (a folder of that name, a parent that is a file, a read-only mount)."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ConfigError(f"{field} {path} is a folder: give a file name")
    blocker = next((a for a in p.parents if a.exists() and not a.is_dir()), None)
    if blocker is not None:
        raise ConfigError(f"{field} {path} lies under the file {blocker}: give a path in a folder")
    try:
        writable_folder(p.parent, field)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace(f"{field} {p.parent}", f"{field} {path}: its folder", 1)) from None
    return p
