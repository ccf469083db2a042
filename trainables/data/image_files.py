"""Image files of an ImageFolder tree or a .zip of one: lazy ``FileImages``, listing, the
train/test/class layout, and the decode cache for small images.

Small images are decoded once into a uint8 array and cached as .npz under $COWTUNE_CACHE
(default ~/.cache/cowtune); large ones stay files, read one by one through ``FileImages.load``.

A folder is walked following symbolic links, each real folder once (a link back up the tree is refused, not
followed until the OS stops it); a link to an image that does not exist is named as an image that cannot be
decoded; 16-bit greyscale images are scaled to 8 bits (PIL's ``convert("RGB")`` clips them to 255).
"""
from __future__ import annotations

import hashlib
import math
import os
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image

from trainables.file_locks import exclusive
from trainables.data.image_decode import UNREADABLE, decode_images, default_workers, open_image
from trainables.validation import ConfigError, check

_CACHE_VERSION = "2"   # 2: 16-bit greyscale images scaled to 8 bits, no longer clipped
_IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
_SPLIT_DIRS = ("train", "test", "val")


@dataclass(frozen=True, eq=False)
class FileImages:
    """Image files of a folder tree or of a .zip, read lazily: ``load(i)`` -> RGB PIL image.

    ``names`` is a numpy string array (not a list) so forked DataLoader workers do not copy it
    page by page through reference counting.
    """
    root: str           # absolute path of the folder or the .zip
    names: np.ndarray   # (N,) paths relative to root (zip member names)

    def __len__(self) -> int:
        return len(self.names)

    def open(self, i: int) -> Image.Image:
        """The i-th image, not yet decoded (PIL reads the header only)."""
        return open_image(self.root, str(self.names[i]), None if os.path.isdir(self.root) else _zip_handle(self.root))

    def load(self, i: int) -> Image.Image:
        return to_rgb(self.open(i))


SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N")   # PIL's 16-bit greyscale (PNG, TIFF)
WIDE_MODES = ("I", "F")   # 32-bit integer and float images: no known range to scale (16-bit PGM aside)


def to_rgb(img: Image.Image) -> Image.Image:
    """``img`` as 8-bit RGB. 16-bit greyscale is scaled (v / 257, rounded): PIL's own ``convert("RGB")`` clips
    it to 0..255, which turned a 16-bit PNG 99.5% white. PIL reads 16-bit PGM as mode I with the 16-bit range."""
    if img.mode in SIXTEEN_BIT_MODES or (img.mode == "I" and img.format == "PPM"):
        wide = np.asarray(img).astype(np.uint32)
        return Image.fromarray(((wide + 128) // 257).astype(np.uint8)).convert("RGB")
    return img.convert("RGB")


_ZIPS: dict[str, tuple[int, zipfile.ZipFile]] = {}


def _zip_handle(path: str) -> zipfile.ZipFile:
    """One open ZipFile per process (DataLoader workers must not share the parent's handle)."""
    hit = _ZIPS.get(path)
    if hit is None or hit[0] != os.getpid():
        hit = (os.getpid(), zipfile.ZipFile(path))
        _ZIPS[path] = hit
    return hit[1]


def _is_image(name: str) -> bool:
    return name.lower().endswith(_IMAGE_EXTS) and not any(p.startswith(".") for p in name.split("/"))


def _list_images(root: str, shown: str, field: str = "data.root", broken: str = "stop") -> list[str]:
    """Relative paths (with '/') of the image files under a folder or inside a .zip, sorted; errors name ``field``.
    A link to an image that does not exist is refused as an image that cannot be decoded, or with ``broken``
    'skip' (data.unreadable=skip) listed for the decoding to leave out and name; a broken link without an
    extension (a class folder's, perhaps) is refused."""
    if os.path.isdir(root):
        out, dangling = _walk(root, shown, field)
        for name, target in dangling:
            if not _is_image(name):
                raise ConfigError(f"{field} {shown!r} holds a broken symbolic link, {name} -> {target} (a class "
                                  "folder's?): mend or remove it")
            if broken != "skip":
                raise unreadable(name, f"a broken symbolic link, to {target}", shown, field)
            out.append(name)
    elif os.path.isfile(root) and zipfile.is_zipfile(root):
        out = _zip_handle(root).namelist()
    elif os.path.isfile(root):
        raise ConfigError(f"{field} must be an ImageFolder tree or a .zip of one, got {shown!r} (a file that is not "
                          "a zip archive)")
    elif os.path.exists(root):
        raise ConfigError(f"{field} must be an ImageFolder tree or a .zip of one, got {shown!r} (neither a folder "
                          "nor a file)")
    else:
        raise ConfigError(f"{field} must be an ImageFolder tree or a .zip of one, got {shown!r} (not found)")
    out = sorted(n for n in out if _is_image(n))
    check(len(out) > 0, field, f"hold image files ({', '.join(_IMAGE_EXTS)}) in class folders", shown)
    return out


def _walk(root: str, shown: str, field: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The files under the folder ``root`` (paths with '/'), following symbolic links but entering each real
    folder once, and the broken links named as images or folders (path, target). Hidden entries are
    skipped. Raises ConfigError naming a link that leads back to a folder above it (a loop: ``os.walk`` follows
    it until the paths grow too long) or to a folder already listed (its images would be read twice)."""
    st = os.stat(root)
    seen = {(st.st_dev, st.st_ino): ""}
    files: list[str] = []
    dangling: list[tuple[str, str]] = []
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            entries = sorted(os.scandir(os.path.join(root, rel)), key=lambda e: e.name, reverse=True)
        except OSError as exc:
            raise ConfigError(f"{field} {shown!r} has a folder that cannot be read, {rel} ({exc.strerror})") from None
        for entry in entries:
            if entry.name.startswith("."):
                continue
            name = f"{rel}/{entry.name}" if rel else entry.name
            try:
                is_dir, is_file = entry.is_dir(), entry.is_file()   # both follow a link
            except OSError:   # a link to itself, say (ELOOP)
                is_dir = is_file = False
            if is_dir:
                st = os.stat(entry.path)
                first = seen.setdefault((st.st_dev, st.st_ino), name)
                if first != name:
                    above = first == "" or name.startswith(first + "/")
                    link = lambda n: n + (" (a link)" if os.path.islink(os.path.join(root, n)) else "")
                    what = (f"a symbolic link loop: {name} leads back to {first or 'the root'}" if above else
                            f"one folder twice, as {link(first)} and as {link(name)}: its images would be read twice")
                    raise ConfigError(f"{field} {shown!r} holds {what}; remove the link")
                stack.append(name)
            elif is_file:
                files.append(name)
            elif entry.is_symlink() and (_is_image(name) or "." not in entry.name):   # an image's, or a folder's
                dangling.append((name, os.readlink(entry.path)))
    return files, dangling


def _layout(names: list[str], shown: str) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]], list[str]]:
    """Split image paths into train and test entries (name, class, key) and the sorted class names.

    A common leading folder (e.g. a zip wrapping the tree) is skipped. With a ``train/`` folder,
    ``test/`` (else ``val/``) is the test split; otherwise every first-level folder is a class.
    ``key`` is the path below the skipped prefix: the same tree as a folder or a zip gives the same keys.
    """
    parts, _ = _skip_wrappers([n.split("/") for n in names])
    entries = [(n, p) for n, p in zip(names, parts) if len(p) >= 2]
    if any(p[0] == "train" and len(p) >= 3 for _, p in entries):
        test_dir = "test" if any(p[0] == "test" for _, p in entries) else "val"
        pick = lambda split: [(n, p[1], "/".join(p)) for n, p in entries if p[0] == split and len(p) >= 3]
        train, test = pick("train"), pick(test_dir)
    else:
        train, test = [(n, p[0], "/".join(p)) for n, p in entries], []
    check(len(train) > 0, "data.root", "hold images in class folders (<root>/<class>/<image>)", shown)
    classes = sorted({c for _, c, _ in train})
    if len(classes) < 2:
        raise ConfigError(f"data.root {shown!r} has one class folder ({classes[0]}): training needs at least 2 "
                          "classes, each a folder of its images")
    extra = sorted({c for _, c, _ in test} - set(classes))
    check(not extra, "data.root", f"have no test classes missing from train ({', '.join(extra)})", shown)
    return train, test, classes


def listed_labels(root: str, shown: str, broken: str = "stop") -> np.ndarray:
    """The training split's class indices of the tree or .zip ``root`` (absolute), from its listing alone (no image
    decoded): what a driver checks the holdout and labeled subset against before any worker loads the data."""
    train, _, classes = _layout(_list_images(root, shown, broken=broken), shown)
    index = {c: i for i, c in enumerate(classes)}
    return np.array([index[c] for _, c, _ in train], dtype=np.int64)


def _skip_wrappers(parts: list[list[str]]) -> tuple[list[list[str]], int]:
    """Path parts below the leading folders every path shares (e.g. a zip wrapping the tree), down to the split
    or class folders, and how many were skipped."""
    skipped = 0
    while (all(len(p) >= 3 for p in parts) and len({p[0] for p in parts}) == 1
           and parts[0][0] not in _SPLIT_DIRS):
        parts, skipped = [p[1:] for p in parts], skipped + 1
    return parts, skipped


@dataclass(frozen=True)
class ScoredImages:
    """The images of a tree to score a model on: ``files`` and each one's class folder name (``classes``).

    folder: where they lie below the tree's root ('' for the root itself, else e.g. 'test' or 'cifar10/test').
    ignored: the other top-level folders beside a split folder, not scored (e.g. ['train']).
    """
    files: FileImages
    classes: list[str]
    folder: str
    ignored: list[str]


def scored_images(root: str, shown: str, field: str) -> ScoredImages:
    """The images to score in the folder or .zip ``root`` (absolute; ``shown`` as the user gave it).

    A tree with split folders (``train/``, ``test/``, ``val/`` holding class folders) is scored on ``test/``, else
    ``val/``, else ``train/`` alone; otherwise every first-level folder is a class and all its images are scored.
    A common leading folder is skipped, as in training (``_layout``).

    Raises:
        ConfigError naming ``field``: not found, no image files, no images in class folders.
    """
    names = _list_images(root, shown, field)
    parts, skipped = _skip_wrappers([n.split("/") for n in names])
    splits = {p[0] for p in parts if len(p) >= 3 and p[0] in _SPLIT_DIRS}
    split = next((s for s in ("test", "val", "train") if s in splits), None)
    if split is None:
        picked = [(n, p[0]) for n, p in zip(names, parts) if len(p) >= 2]
        ignored: list[str] = []
    else:
        picked = [(n, p[1]) for n, p in zip(names, parts) if len(p) >= 3 and p[0] == split]
        ignored = sorted({p[0] for p in parts if len(p) >= 2} - {split})
    check(len(picked) > 0, field, "hold images in class folders (<class>/<image>, or test/<class>/<image>)", shown)
    folder = "/".join(names[0].split("/")[:skipped] + ([split] if split else []))
    return ScoredImages(FileImages(root, np.array([n for n, _ in picked])), [c for _, c in picked], folder, ignored)


def _cache_dir() -> Path:
    return Path(os.environ.get("COWTUNE_CACHE") or Path.home() / ".cache" / "cowtune")


def _source_key(root: str, files: Sequence[FileImages | None]) -> str:
    """Cache key: the resolved path (a link to it shares its cache), size and mtime of the zip, or of every
    listed file of a folder."""
    st = os.stat(root)
    h = hashlib.sha256(f"v{_CACHE_VERSION}|{os.path.realpath(root)}|{st.st_size}|{st.st_mtime_ns}".encode())
    if os.path.isdir(root):
        for fi in files:
            for name in (fi.names if fi is not None else ()):
                try:
                    s = os.stat(os.path.join(root, str(name)))
                    h.update(f"|{name}|{s.st_size}|{s.st_mtime_ns}".encode())
                except OSError:   # a link to nothing, listed for data.unreadable=skip to leave out
                    h.update(f"|{name}|missing".encode())
    for fi in files:
        h.update(f"|split:{len(fi) if fi is not None else -1}".encode())
    return h.hexdigest()[:24]


def _decode_cached(root: str, shown: str, train: FileImages, test: FileImages | None,
                   skip: bool = False) -> dict[str, np.ndarray]:
    """Decode every image to uint8 (N, H, W, 3) once; later calls read the .npz cache.

    Returns {"train": ..., "test": ... (when there is a test split), "mean": (3,), "std": (3,)}; with ``skip``,
    files that cannot be decoded are left out (each named once) and "train_kept"/"test_kept" index the others.
    """
    path = _cache_dir() / f"imagefolder-{_source_key(root, (train, test))}{'-skip' if skip else ''}.npz"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # one process decodes, the others (packed trials, a search driver warming the cache) wait and read it
        with exclusive(path.with_suffix(".lock")) as lock:
            if not path.exists():
                return _decode_to_cache(path, shown, train, test, skip)
        print(f"data: waited {lock['waited_s']:.1f} s for another process decoding {shown}", flush=True)
    t0 = time.perf_counter()
    with np.load(path, allow_pickle=False) as z:
        out = {k: z[k] for k in z.files}
    print(f"data: loaded {len(out['train'])} decoded images of {shown} from cache {path} "
          f"in {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def _decode_to_cache(path: Path, shown: str, train: FileImages, test: FileImages | None,
                     skip: bool = False) -> dict[str, np.ndarray]:
    t0 = time.perf_counter()
    workers = default_workers(len(train) + (len(test) if test is not None else 0))
    out = {}
    for split, files in (("train", train), ("test", test)):
        if files is not None:
            out[split], kept = _decode_all(files, shown, workers, skip)
            if skip:
                out[f"{split}_kept"] = kept
    if test is not None:
        check(out["test"].shape[1:] == out["train"].shape[1:], "data.root",
              "hold test images of the training image size", shown)
    mean, std = _channel_stats(out["train"])
    out["mean"], out["std"] = np.array(mean), np.array(std)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
    np.savez(tmp, **out)
    os.replace(tmp, path)  # atomic: concurrent trials never read a half-written cache
    n = len(out["train"]) + (len(out["test"]) if test is not None else 0)
    print(f"data: decoded {n} images of {shown} in {time.perf_counter() - t0:.1f} s "
          f"({workers} process{'es' if workers > 1 else ''}), cached to {path}", flush=True)
    return out


def _decode_all(files: FileImages, shown: str, workers: int | None = None,
                skip: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(N, H, W, 3) uint8 and the (N,) indices of ``files`` they are, decoded by ``workers`` processes (default: by
    the count, ``trainables.data.image_decode.default_workers``); every image must have the first image's size. A file
    that cannot be decoded stops it, named, or with ``skip`` is left out and named."""
    names, parts, kept = [str(n) for n in files.names], [], []
    start, size = first_readable(files, shown, skip)   # the workers decode every image, the first included
    skipped = names[:start]
    while start < len(names):
        out, bad = decode_images(files.root, names[start:], size, workers)
        parts.append(out)
        kept.append(np.arange(start, start + len(out)))
        if bad is None:
            break
        i = start + bad[0]
        if isinstance(bad[1], str) and not skip:
            raise unreadable(names[i], bad[1], shown)
        if not isinstance(bad[1], str):
            raise ConfigError(
                f"data.root must hold images of one size for the device pipeline (first is "
                f"{size[0]}x{size[1]}, {names[i]} is {bad[1][0]}x{bad[1][1]}); "
                f"for mixed sizes use {mixed_size_sets(size, bad[1])}, got {shown!r}")
        skipped.append(names[i])
        start = i + 1
    if skipped:
        print(f"data: skipped {len(skipped)} image file{'s' if len(skipped) > 1 else ''} of {shown} that cannot be "
              f"decoded (data.unreadable=skip): {', '.join(skipped[:20])}{' ...' if len(skipped) > 20 else ''}",
              flush=True)
    check(bool(parts) and sum(len(p) for p in parts) > 0, "data.root", "hold at least one image that decodes", shown)
    images, kept = np.concatenate(parts), np.concatenate(kept)
    rescale_wide(files, images, kept, shown)
    return images, kept


def rescale_wide(files: FileImages, images: np.ndarray, kept: np.ndarray, shown: str,
                 field: str = "data.root") -> None:
    """Decode again, in place, the images of ``files`` (rows of ``images``: ``kept[row]``) that hold more than 8
    bits a channel, which ``trainables.data.image_decode`` clipped: 16-bit greyscale scaled (``to_rgb``); a 32-bit or
    float image, whose range is unknown, is refused naming it. Only PNG headers (26 bytes), and TIFF and PGM
    headers are read: JPEG, BMP, GIF and WebP decode to 8 bits."""
    row = {int(i): r for r, i in enumerate(kept)}
    for i, name in enumerate(str(n) for n in files.names):
        ext = name.lower().rsplit(".", 1)[-1]
        if i not in row or ext not in ("png", "tif", "tiff", "pgm", "ppm"):
            continue
        if ext == "png":   # bit depth and colour type: byte 24 and 25 (IHDR); 16-bit colour PIL reads right
            if _png_header(files, name)[24:26] != b"\x10\x00":
                continue
        img = files.open(i)
        if img.mode in WIDE_MODES and not (img.mode == "I" and img.format == "PPM"):
            kind = "32-bit integers" if img.mode == "I" else "floats"
            raise ConfigError(f"{field} {shown!r} holds an image of {kind} (mode {img.mode}), {name}, whose range "
                              "cannot be told: save it with 8 or 16 bits")
        if img.mode in SIXTEEN_BIT_MODES or img.mode == "I":
            images[row[i]] = np.asarray(to_rgb(img))


def _png_header(files: FileImages, name: str) -> bytes:
    try:
        if os.path.isdir(files.root):
            with open(os.path.join(files.root, name), "rb") as f:
                return f.read(26)
        with _zip_handle(files.root).open(name) as f:
            return f.read(26)
    except OSError:
        return b""


def first_readable(files: FileImages, shown: str, skip: bool) -> tuple[int, tuple[int, int]]:
    """The position and (width, height) of the first image whose header reads: the first image, or with ``skip``
    the first after those that do not read."""
    for i in range(len(files) if skip else 1):
        try:
            return i, files.open(i).size   # the header only
        except UNREADABLE as exc:   # not an image, or a truncated header: named as any other undecodable file
            if not skip:
                raise unreadable(files.names[0], f"{type(exc).__name__}: {str(exc)[:200]}", shown) from None
    raise ConfigError(f"data.root {shown!r} holds no image that can be decoded")


def unreadable(name: str, reason: str, shown: str, field: str = "data.root") -> ConfigError:
    return ConfigError(f"{field} {shown!r} holds an image that cannot be decoded, {name} ({reason}): remove or "
                       "replace it (its folder names its class), or leave such files out with "
                       "--set data.unreadable=skip")


def _channel_stats(images: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std on the 0..1 scale of uint8 (N, H, W, C), exact via histograms."""
    values = np.arange(256, dtype=np.float64) / 255.0
    mean, std = [], []
    for c in range(images.shape[-1]):
        counts = np.bincount(images[..., c].ravel(), minlength=256).astype(np.float64)
        m = float((counts * values).sum() / counts.sum())
        mean.append(m)
        std.append(max(float(math.sqrt((counts * (values - m) ** 2).sum() / counts.sum())), 1e-3))
    return tuple(mean), tuple(std)


def mixed_size_sets(first: tuple[int, int], other: tuple[int, int]) -> str:
    """The overrides that read a folder of mixed image sizes: the loader at the larger side seen (not 224 px, which
    would upsample small images), with no more loader workers than this machine has cores."""
    side = max(*first, *other)
    workers = min(4, os.cpu_count() or 1)
    return f"--set data.pipeline=loader --set data.image_size={side} --set data.workers={workers}"
