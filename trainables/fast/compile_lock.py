"""The first compilation of a step on a machine runs alone, so that packed trials reuse its kernels.

Trials packed on one GPU compile the same model graphs. Started together with empty caches, each
compiles them from scratch, all at once, on the same CPU cores (four WRN-28-2 CowMix trials on a
16-core H100 host: 71-79 s before anyone's first epoch ends, the GPU idle meanwhile). Under this lock
the first one compiles alone (48-56 s there) and fills Inductor's on-disk caches; the others wait
for it, then start together on what it wrote (23-29 s each, while it already trains; one at a time
they took 22-27 s each). Once a step of that kind has compiled on the machine, a marker in the cache
folder says so and later processes compile at once, without the lock.

The lock is an advisory ``flock`` on a file in Inductor's cache folder, the scope of what is shared;
the kernel releases it if its holder dies.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import time
from pathlib import Path
from typing import Iterator

from trainables.file_locks import try_lock

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


def _marker(key: str) -> Path:
    return cache_folder() / f"cowtune-compiled-{key}"


def compiled_before(key: str) -> bool:
    """Whether a step named ``key`` has compiled on this machine (its marker is in the cache folder)."""
    return _marker(key).exists()


MAX_WAIT_S = 900.0   # a compilation that holds the lock longer is stuck: compile without it


@contextlib.contextmanager
def first_compile_lock(key: str, enabled: bool = True, max_wait_s: float = MAX_WAIT_S) -> Iterator[dict[str, float]]:
    """Compile the step named by ``key`` in the body: at once if one like it has compiled on this machine
    before; else alone if no other process is compiling, or once the one that is has finished (alongside
    the others that waited for it), or after ``max_wait_s`` regardless. Yields {"waited_s": seconds waited}."""
    info = {"waited_s": 0.0}
    folder = cache_folder()
    if not enabled or compiled_before(key):
        yield info
        return
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK_NAME, "a") as handle:
        if not try_lock(handle, fcntl.LOCK_EX):   # someone is compiling (else: compile, others wait)
            # shared: granted to all waiters once the compiling process lets go
            t0 = time.monotonic()
            while not try_lock(handle, fcntl.LOCK_SH) and time.monotonic() - t0 < max_wait_s:
                time.sleep(0.2)
            info["waited_s"] = time.monotonic() - t0
        try:
            yield info
            _marker(key).touch()
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def step_key(*parts: object) -> str:
    """A short name for what a step's compiled graphs depend on (model, shapes, settings, torch version)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:20]


# Our operators whose autograd formulas and fake implementations the compiled graphs call: Dynamo's graph names
# an operator, not what its backward does, so Inductor's and AOTAutograd's on-disk caches cannot tell when these
# change (a cached backward of the old code would call the new operator with the old arguments).
OPERATOR_SOURCES = ("fast_conv.py", "wgrad_stream.py", "conv_bias_relu.py", "stored_grad.py")


@functools.cache
def operators_version() -> str:
    """A hash of ``OPERATOR_SOURCES``: part of every compile-cache key (``tag_compile_caches``) and of the
    first-compile marker's, so a changed operator compiles afresh instead of loading code cached for the old one."""
    digest = hashlib.sha256()
    for name in OPERATOR_SOURCES:
        digest.update((Path(__file__).parent / name).read_bytes())
    return digest.hexdigest()[:16]


def tag_compile_caches(*extra: str) -> None:
    """Add ``operators_version()``, then each of ``extra``, to torch.compile's cache-key tag
    (``torch.compiler.config.cache_key_tag``, in every on-disk cache's key; a tag the user set is kept before them,
    and one already there is not added again, so processes spell it alike whatever they called first)."""
    import torch.compiler.config as compiler

    if not hasattr(compiler, "cache_key_tag"):   # an older torch: its caches are not keyed by a tag
        return
    for ours in (f"cowtune-operators-{operators_version()}", *extra):
        if ours not in compiler.cache_key_tag.split("+"):
            compiler.cache_key_tag = f"{compiler.cache_key_tag}+{ours}" if compiler.cache_key_tag else ours
