"""A run's checkpoint on disk: written so that a crash or a full disk never leaves it half-written, read without
running code from the file, and recovered from the epoch before when it is damaged.

``save`` writes a temporary file, syncs it, keeps the checkpoint it replaces as ``<name>.prev`` (``keep_previous``)
and renames the new one into place; a failed write (a full disk) removes the temporary file and leaves the last
checkpoint as it was, and says the kernel's reason (``write_failure``); ``write_text`` writes a run's small files
(its metrics, config, result) the same way. ``load`` reads with ``torch.load(weights_only=True)``: tensors and plain data only, so a
checkpoint holding any other object (tampered with, or not written by cowtune) is refused, never executed. A
checkpoint that cannot be read as a file (truncated, say) is set aside and the previous one is read instead.
"""
from __future__ import annotations

import errno
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch

from trainables.validation import CheckpointWriteError, ConfigError


def previous(path: Path) -> Path:
    return path.with_name(path.name + ".prev")


def save(obj: Any, path: Path, keep_previous: bool = True) -> None:
    """Write ``obj`` to ``path`` atomically; with ``keep_previous`` the checkpoint it replaces stays as ``.prev``."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as exc:   # torch's zip writer reports a short write as a RuntimeError
        tmp.unlink(missing_ok=True)
        last = f"the last one, {path}, is intact" if path.exists() else "no earlier checkpoint exists"
        why = write_failure(exc)
        raise CheckpointWriteError(f"could not write the checkpoint {path} ({why}); {last}: "
                                   "free the space (or fix the folder) and run the same command to resume") from None
    if keep_previous and path.exists():
        os.replace(path, previous(path))
    os.replace(tmp, path)


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a synced temporary file renamed into place): a full disk leaves the
    file as it was, never cut short. Raises the OSError (ENOSPC...) naming ``path``, the temporary file removed."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:   # raised by the flush or the close without a file name: said with the file's
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    os.replace(tmp, path)


def write_failure(exc: BaseException) -> str:
    """Why a write failed: the kernel's reason ("No space left on device") where an OSError is behind ``exc``
    (PyTorch's zip writer reports a full disk as "unexpected pos N vs M", the OSError only its context), else the
    first line of ``exc``."""
    cause: BaseException | None = exc
    while cause is not None and not (isinstance(cause, OSError) and cause.strerror):
        cause = cause.__cause__ or cause.__context__
    return cause.strerror if cause is not None else str(exc).splitlines()[0][:200]


class CutShort(zipfile.BadZipFile):
    """A checkpoint whose zip directory points past its end: PyTorch's reader seeks there (EINVAL)."""


def _read(path: Path) -> Any:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as exc:
        if exc.errno == errno.EINVAL:   # cut short (a crash mid-copy): damaged, not a file that cannot be opened
            raise CutShort(f"cut short ({exc.strerror})") from None
        raise
    except pickle.UnpicklingError as exc:
        if "weights_only" in str(exc) or "Weights only" in str(exc):
            raise ConfigError(f"{path} holds objects other than tensors and plain data, so it was not written by "
                              "cowtune or was altered afterwards; it is refused unread (move it away, or pass "
                              "--restart to start over)") from None
        raise
    return state


def _checked(state: Any, path: Path) -> dict[str, Any]:
    if not isinstance(state, dict):   # read whole, but not ours: not damaged, not set aside
        raise ConfigError(f"{path} is not a checkpoint written by cowtune (a PyTorch file holding a "
                          f"{type(state).__name__}); move it away, or pass --restart to start over")
    return state


DAMAGED = (RuntimeError, EOFError, zipfile.BadZipFile, pickle.UnpicklingError, ValueError)


def load(path: Path, log: Callable[[str], None] = print) -> dict[str, Any] | None:
    """The checkpoint at ``path`` (None if there is none). A damaged one (a truncated file, say) is renamed
    ``.damaged`` and the previous one is read in its place; raises ConfigError if neither can be read, or if a
    file holds more than tensors and plain data."""
    if not path.exists():
        return None
    try:
        state = _read(path)
    except DAMAGED as exc:
        why = str(exc) if isinstance(exc, CutShort) else \
            f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}" if str(exc) else type(exc).__name__
    else:
        return _checked(state, path)
    prev = previous(path)
    if not prev.exists():
        raise ConfigError(f"{path} cannot be read ({why}) and there is no previous checkpoint to go back to; "
                          "pass --restart to start over")
    try:
        state = _checked(_read(prev), prev)
    except DAMAGED as exc:
        raise ConfigError(f"{path} cannot be read ({why}), nor can the previous one, {prev} "
                          f"({type(exc).__name__}); pass --restart to start over") from None
    damaged = path.with_name(path.name + ".damaged")
    os.replace(path, damaged)
    os.replace(prev, path)
    log(f"checkpoint {path} cannot be read ({why}); kept it as {damaged.name} and resumed from the previous one "
        f"(epoch {state.get('epoch', '?')})")
    return state
