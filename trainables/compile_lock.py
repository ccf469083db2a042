"""The first compilation on a machine runs alone, so that packed trials reuse its kernels.

Trials packed on one GPU compile the same model graphs. Started together, each compiles them from
scratch, all at once, on the same CPU cores (four WRN-28-2 CowMix trials on a 16-core H100 host:
71-79 s before anyone's first epoch ends, the GPU idle meanwhile). Under this lock the first one
compiles alone and fills Inductor's on-disk caches; the others wait for it and then start together,
loading what it wrote, while it already trains. (One at a time they took 22-27 s each after the first
one's 56 s on that host.) The lock is an advisory ``flock`` on a file in Inductor's cache folder, the
scope of what is shared; the kernel releases it if its holder dies.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path
from typing import Iterator

LOCK_NAME = "cowtune-first-compile.lock"


def cache_folder() -> Path:
    """Inductor's cache folder: ``TORCHINDUCTOR_CACHE_DIR``, else its per-user default."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        return Path(cache_dir())
    except ImportError:   # an older layout of torch
        import getpass
        import tempfile
        return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR")
                    or Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")


@contextlib.contextmanager
def first_compile_lock(enabled: bool = True) -> Iterator[dict[str, float]]:
    """Compile in the body: alone if no other process is compiling, else once the one that is has finished
    (then alongside the others that waited for it). Yields {"waited_s": seconds spent waiting}."""
    info = {"waited_s": 0.0}
    if not enabled:
        yield info
        return
    folder = cache_folder()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK_NAME, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)   # nobody compiling: compile, others wait
        except BlockingIOError:
            t0 = time.monotonic()
            fcntl.flock(handle, fcntl.LOCK_SH)   # granted when the compiling process lets go, to all waiters
            info["waited_s"] = time.monotonic() - t0
        try:
            yield info
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
