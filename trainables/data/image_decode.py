"""Decode many small image files to one uint8 array, in worker processes when there are many.

Decoding CIFAR-10's 50,000 JPEGs one by one takes about 13 s on a server core (Python and PIL
per image); split over processes it takes a second or two. This module imports only numpy and
PIL (not torch, not the ``trainables.data`` package), so a worker it spawns starts in a fraction
of a second. ``trainables.data.image_files`` caches what it returns.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image

from trainables.child_process import module_command

MIN_IMAGES_PER_WORKER = 2000   # below this a process costs more than it saves
MAX_WORKERS = 8


def default_workers(n_images: int) -> int:
    """Processes for ``n_images``: one per ``MIN_IMAGES_PER_WORKER`` images, at most the usable cores and 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_WORKERS, n_images // MIN_IMAGES_PER_WORKER))


def open_image(root: str, name: str, zf: zipfile.ZipFile | None) -> Image.Image:
    """Image ``name`` of the folder ``root``, or member ``name`` of the open zip ``zf`` (header read only)."""
    if zf is None:
        return Image.open(os.path.join(root, name))
    return Image.open(io.BytesIO(zf.read(name)))


# What PIL raises for a file it cannot decode: truncated (OSError), not an image (UnidentifiedImageError, an
# OSError), a broken header (SyntaxError, ValueError), a decompression bomb
UNREADABLE = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)


SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N")   # PIL's 16-bit greyscale (PNG, TIFF)


def to_rgb(img: Image.Image) -> Image.Image:
    """``img`` as 8-bit RGB. 16-bit greyscale is scaled (v / 257, rounded): PIL's own ``convert("RGB")`` clips it
    to 0..255, which turned a 16-bit PNG 99.5% white. PIL reads 16-bit PGM as mode I with the 16-bit range."""
    if img.mode in SIXTEEN_BIT_MODES or (img.mode == "I" and img.format == "PPM"):
        wide = np.asarray(img).astype(np.uint32)
        return Image.fromarray(((wide + 128) // 257).astype(np.uint8)).convert("RGB")
    return img.convert("RGB")


def decode_range(root: str, names: Sequence[str], size: tuple[int, int]
                 ) -> tuple[np.ndarray, tuple[int, tuple[int, int] | str] | None]:
    """Decode ``names`` (paths in the folder or members of the zip ``root``) to RGB uint8 (N, H, W, 3) (``to_rgb``).
    Returns (array, None), or (partial array, (position, (width, height))) at the first image whose
    size is not ``size`` (width, height), or (partial array, (position, reason)) at the first that cannot be
    decoded (a truncated or corrupt file)."""
    zf = None if os.path.isdir(root) else zipfile.ZipFile(root)
    try:
        out = np.empty((len(names), size[1], size[0], 3), dtype=np.uint8)
        for i, name in enumerate(names):
            try:
                img = to_rgb(open_image(root, name, zf))   # 16-bit greyscale scaled to 8 bits, not clipped
            except UNREADABLE as exc:
                return out[:i], (i, f"{type(exc).__name__}: {str(exc)[:200]}")
            if img.size != size:
                return out[:i], (i, img.size)
            out[i] = np.asarray(img)
        return out, None
    finally:
        if zf is not None:
            zf.close()


def decode_images(root: str, names: Sequence[str], size: tuple[int, int], workers: int | None = None
                  ) -> tuple[np.ndarray, tuple[int, tuple[int, int] | str] | None]:
    """``decode_range`` over all of ``names``, in contiguous ranges over ``workers`` processes (default
    ``default_workers``); the same result as one process, mismatch position included.

    The workers are plain ``python -m trainables.data.image_decode`` processes, not a multiprocessing pool:
    its spawned workers would first import the caller's ``__main__`` (a search script importing Ray,
    MLflow and torch), and forking a process with threads running (a search driver) is unsafe."""
    names = [str(n) for n in names]
    workers = default_workers(len(names)) if workers is None else min(workers, len(names))
    if workers <= 1:
        return decode_range(root, names, size)
    bounds = np.linspace(0, len(names), workers + 1).astype(int)
    with tempfile.TemporaryDirectory(prefix="cowtune-decode-") as tmp:
        Path(tmp, "names.json").write_text(json.dumps(names), encoding="utf-8")
        commands = [module_command("trainables.data.image_decode", root, f"{tmp}/names.json", str(a), str(b),
                                   str(size[0]), str(size[1]), f"{tmp}/{a}.npy") for a, b in zip(bounds[:-1], bounds[1:])]
        procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for argv, env in commands]
        results = [(p, *p.communicate()) for p in procs]
        for p, _, err in results:
            if p.returncode != 0:
                raise RuntimeError(f"decoding images of {root} failed in a worker process:\n{err[-2000:]}")
        parts = []
        for a, (p, out, _) in zip(bounds[:-1], results):
            parts.append(np.load(f"{tmp}/{a}.npy"))
            bad = json.loads(out.strip().splitlines()[-1])
            if bad is not None:
                return np.concatenate(parts), (int(a) + bad[0], bad[1] if isinstance(bad[1], str) else tuple(bad[1]))
    return np.concatenate(parts), None


def _worker(argv: list[str]) -> None:
    """``python -m trainables.data.image_decode ROOT NAMES_FILE START END WIDTH HEIGHT OUT.npy``: decode one
    range to OUT.npy and print the mismatch (JSON, null when none)."""
    root, names_file, start, end, width, height, out = argv
    names = json.loads(Path(names_file).read_text(encoding="utf-8"))[int(start):int(end)]
    images, bad = decode_range(root, names, (int(width), int(height)))
    np.save(out, images)
    print(json.dumps(bad), flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1:])
