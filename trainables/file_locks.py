"""Advisory file locks shared by processes on one machine (``flock``: released by the kernel if the
holder dies). Used for the decode cache, the first compilation and packed trials' GPU turns."""
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
