"""Advisory file locks shared by processes on one machine (``flock``: released by the kernel if the
holder dies). Used for the decode cache, the first compilation, packed trials' GPU turns, and the folders of a
search, a final job and a ``cowtune train`` run (one writer each)."""
from __future__ import annotations

import contextlib
import fcntl
import time
from pathlib import Path
from typing import IO, Iterator


def try_lock(handle: IO, mode: int) -> bool:
    """Take ``mode`` (fcntl.LOCK_EX or LOCK_SH) on ``handle`` if that is possible now."""
    try:
        fcntl.flock(handle, mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[dict[str, float]]:
    """Hold an exclusive lock on ``path`` (created if missing) for the body; yields {"waited_s": ...}."""
    with open(path, "a") as handle:
        t0 = time.monotonic()
        fcntl.flock(handle, fcntl.LOCK_EX)
        info = {"waited_s": time.monotonic() - t0}
        try:
            yield info
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


_HELD: dict[str, IO] = {}   # job locks this process holds until it exits (the kernel releases them then)


def hold_job_lock(path: Path, what: str) -> None:
    """Hold an exclusive lock on ``path`` for the rest of this process, with who holds it written inside; raises
    ConfigError naming the holder if another process (on this machine, or one sharing the folder) holds it.
    ``what`` names the job in the message ("search cifar10_cowmix")."""
    key = str(Path(path).resolve())
    if key not in _HELD:
        _HELD[key] = _take_job_lock(path, what, "pass --name NEW for another")


@contextlib.contextmanager
def job_lock(path: Path, what: str, other: str) -> Iterator[None]:
    """``hold_job_lock`` for the body only (``cowtune train``'s --out: a process may train several runs in turn);
    ``other`` ends the refusal ("pass another --out")."""
    handle = _take_job_lock(path, what, other)
    try:
        yield
    finally:
        handle.close()   # releases the lock; the file stays, as a job's does


def _take_job_lock(path: Path, what: str, other: str) -> IO:
    import json
    import os
    import socket
    import sys

    from trainables.validation import ConfigError

    handle = open(path, "a+")
    if not try_lock(handle, fcntl.LOCK_EX):
        handle.seek(0)
        try:
            holder = json.loads(handle.read() or "{}")
        except ValueError:
            holder = {}
        handle.close()
        who = (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} since {holder.get('since', '?')}: "
               f"{holder.get('command', '?')}") if holder else "another process"
        raise ConfigError(f"{what} is running already ({who}); wait for it to end, or {other}")
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)[:500]}))
    handle.flush()
    return handle
