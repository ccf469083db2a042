"""Datasets, splits and batches for semi-supervised training.

``prepare_data(cfg, labeled_seed, device)`` is the entry point the trainer uses. It loads a
dataset from the ``DATASETS`` registry, carves the validation holdout and the labeled subset
(``make_splits``, stratified as in the reference ``small_image_data_source.py``) and returns a
``TrainData``:

* ``DeviceData`` (small images): the whole decoded uint8 dataset lives on the training device;
  a batch is one gather that does reflect-pad, random crop and flip at once, then a normalise.
* ``LoaderData`` (large images, ImageFolder/ImageNet layout): files are read lazily by a
  DataLoader; inception crop + flip (+ colour jitter) per sample, as in the reference ImageNet
  pipeline.

Determinism: ``train_batches(epoch, seed, ...)`` is a pure function of the data and its
arguments. It derives its own generators from (seed, epoch, stream) and never reads the global
RNG, so a run resumed at an epoch boundary sees the same batches bit-for-bit.

Reference: "Milking CowMask for Semi-Supervised Image Classification", French, Oliver and
Salimans, arXiv:2003.12022, and its published code (``milking_cowmask/data_sources``).
"""
from __future__ import annotations

import hashlib
import io
import math
import os
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Protocol, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from trainables.validation import ConfigError, check, unknown_name

if TYPE_CHECKING:
    from trainables.config import DataConfig

# Per-channel mean and std on the 0..1 scale (reference section 4.1 / 4.2).
NORMALISATION: dict[str, tuple[tuple[float, float, float], tuple[float, float, float]]] = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4866, 0.4409), (0.2673, 0.2564, 0.2761)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}
SMALL_IMAGE_MAX = 64          # "auto" pipeline: images up to this side go to the device pipeline
LOADER_IMAGE_SIZE = 224       # default training crop of the loader pipeline for files
INCEPTION_SCALE = (0.05, 1.0)  # area fraction of the inception crop (reference 4.2)
INCEPTION_RATIO = (3 / 4, 4 / 3)
EVAL_CROP = 0.875             # eval: centre crop of 0.875 x short side, resized to image_size
_CACHE_VERSION = "1"
_IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
_SPLIT_DIRS = ("train", "test", "val")


# ---------------------------------------------------------------------------------------------
# Public types
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class Batch:
    """One training step's data, already on the training device.

    x_sup: (B, C, H, W) float32, augmented and normalised; y_sup: (B,) int64.
    x_unsup0: (B, C, H, W) augmented unlabeled view (the teacher's view and the mix source).
    x_unsup1: an independent second augmentation when ``augment_twice``, else the same object.
    """
    x_sup: Tensor
    y_sup: Tensor
    x_unsup0: Tensor
    x_unsup1: Tensor


class TrainData(Protocol):
    """What ``prepare_data`` returns; ``DeviceData`` and ``LoaderData`` implement it."""
    num_classes: int
    class_names: list[str]
    image_shape: tuple[int, int, int]   # (C, H, W) of training batches
    sizes: dict[str, int]               # train, val, labeled, unlabeled, test (0 = none)
    split_hashes: dict[str, str]        # val, labeled, unlabeled -> 16 hex chars

    def default_steps_per_epoch(self, batch_size: int) -> int: ...
    def train_batches(self, epoch: int, seed: int, batch_size: int, steps: int,
                      augment_twice: bool) -> Iterator[Batch]: ...
    def eval_batches(self, split: str, batch_size: int) -> Iterator[tuple[Tensor, Tensor]]: ...
    def describe(self) -> str: ...


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
        name = str(self.names[i])
        if os.path.isdir(self.root):
            return Image.open(os.path.join(self.root, name))
        return Image.open(io.BytesIO(_zip_handle(self.root).read(name)))

    def load(self, i: int) -> Image.Image:
        return self.open(i).convert("RGB")


@dataclass(frozen=True, eq=False)
class RawDataset:
    """A dataset as a loader returns it: undecoded splits, labels and normalisation.

    train_images: (N, H, W, C) uint8 array, or ``FileImages`` for lazily read large images.
    train_labels: (N,) int64. test_images / test_labels: likewise, or None (no test split).
    mean, std: per channel on the 0..1 scale. flip: the dataset's default for horizontal flips.
    fingerprint: identifies the dataset contents (not its location) in split hashes.
    """
    name: str
    train_images: np.ndarray | FileImages
    train_labels: np.ndarray
    test_images: np.ndarray | FileImages | None
    test_labels: np.ndarray | None
    class_names: list[str]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    flip: bool
    fingerprint: str


@dataclass(frozen=True, eq=False)
class Splits:
    """Sorted int64 index arrays into the train split, and their hashes (16 hex chars each).

    The unlabeled pool is every non-validation image, so it contains the labeled subset.
    """
    val: np.ndarray
    labeled: np.ndarray
    unlabeled: np.ndarray
    hashes: dict[str, str]


# ---------------------------------------------------------------------------------------------
# Registry and loaders
# ---------------------------------------------------------------------------------------------

Loader = Callable[["DataConfig"], RawDataset]
DATASETS: dict[str, Loader] = {}


def register_dataset(name: str) -> Callable[[Loader], Loader]:
    """Decorator: register ``fn(cfg: DataConfig) -> RawDataset`` under ``name``; raises on duplicates."""
    def add(fn: Loader) -> Loader:
        if name in DATASETS:
            raise ValueError(f"dataset '{name}' is already registered by {DATASETS[name].__qualname__}")
        DATASETS[name] = fn
        return fn
    return add


def load_raw(cfg: "DataConfig") -> RawDataset:
    """Load ``cfg.dataset`` through its registered loader. Raises ConfigError for unknown names."""
    if cfg.dataset not in DATASETS:
        raise unknown_name("dataset", cfg.dataset, DATASETS)
    return DATASETS[cfg.dataset](cfg)


# What torchvision's loaders look for under data.root; the driver-side check needs nothing else.
TORCHVISION_FILES = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python", "svhn": "train_32x32.mat"}


def _missing_files_error(cfg: "DataConfig", detail: str = "") -> ConfigError:
    root = os.path.expanduser(cfg.root)
    folder = root.lower().endswith(".zip") or (os.path.isdir(root) and not os.path.exists(
        os.path.join(root, TORCHVISION_FILES.get(cfg.dataset, ""))) and bool(os.listdir(root)))
    hint = "; it looks like an ImageFolder tree or zip: add `--set data.dataset=imagefolder`" if folder else \
        " or pass `--set data.download=true` to fetch them"
    return ConfigError(f"data.root must point at the {cfg.dataset} files in torchvision's layout "
                       f"({TORCHVISION_FILES.get(cfg.dataset, '?')}), got {cfg.root!r}{detail}{hint}")


def check_source(cfg: "DataConfig") -> None:
    """Cheap check that ``cfg`` names data a loader can read, for a driver before it starts workers.

    Lists an ImageFolder tree or zip (no decoding) or looks for torchvision's files; raises ConfigError.
    """
    if cfg.dataset not in DATASETS:
        raise unknown_name("dataset", cfg.dataset, DATASETS)
    root = os.path.abspath(os.path.expanduser(cfg.root))
    if cfg.dataset == "imagefolder":
        _layout(_list_images(root, cfg.root), cfg.root)
    elif cfg.dataset in TORCHVISION_FILES and not cfg.download:
        if not os.path.exists(os.path.join(root, TORCHVISION_FILES[cfg.dataset])):
            raise _missing_files_error(cfg)


TRAIN_SIZES = {"cifar10": 50000, "cifar100": 50000, "svhn": 73257, "digits": 1797}


def train_size(cfg: "DataConfig") -> int | None:
    """Number of training images ``cfg`` names, without decoding any; None when it cannot tell."""
    if cfg.dataset == "imagefolder":
        try:
            return len(_layout(_list_images(os.path.abspath(os.path.expanduser(cfg.root)), cfg.root), cfg.root)[0])
        except ConfigError:
            return None
    return TRAIN_SIZES.get(cfg.dataset)


def _torchvision_split(cfg: "DataConfig", make: Callable[[str, bool], object]) -> object:
    root = os.path.expanduser(cfg.root)
    try:
        return make(root, cfg.download)
    except RuntimeError as exc:  # torchvision: "Dataset not found or corrupted"
        raise _missing_files_error(cfg, f" ({exc})") from None


def _torchvision_dataset(cfg: "DataConfig", make: Callable[[str, bool, bool], object]) -> RawDataset:
    """CIFAR-style torchvision datasets: ``.data`` (N, H, W, C) uint8 and ``.targets``."""
    train = _torchvision_split(cfg, lambda root, dl: make(root, True, dl))
    test = _torchvision_split(cfg, lambda root, dl: make(root, False, dl))
    labels = np.asarray(train.targets, dtype=np.int64)
    mean, std = NORMALISATION[cfg.dataset]
    return RawDataset(cfg.dataset, np.ascontiguousarray(train.data), labels, np.ascontiguousarray(test.data),
                      np.asarray(test.targets, dtype=np.int64), list(train.classes), mean, std, True,
                      _fingerprint(cfg.dataset, labels))


@register_dataset("cifar10")
def _load_cifar10(cfg: "DataConfig") -> RawDataset:
    from torchvision.datasets import CIFAR10
    return _torchvision_dataset(cfg, lambda root, train, dl: CIFAR10(root, train=train, download=dl))


@register_dataset("cifar100")
def _load_cifar100(cfg: "DataConfig") -> RawDataset:
    from torchvision.datasets import CIFAR100
    return _torchvision_dataset(cfg, lambda root, train, dl: CIFAR100(root, train=train, download=dl))


@register_dataset("svhn")
def _load_svhn(cfg: "DataConfig") -> RawDataset:
    """SVHN train (73,257) and test; no 'extra'. Not flipped by default (the reference flips it)."""
    from torchvision.datasets import SVHN
    train = _torchvision_split(cfg, lambda root, dl: SVHN(root, split="train", download=dl))
    test = _torchvision_split(cfg, lambda root, dl: SVHN(root, split="test", download=dl))
    labels = np.asarray(train.labels, dtype=np.int64)
    mean, std = NORMALISATION["svhn"]
    nhwc = lambda a: np.ascontiguousarray(np.asarray(a).transpose(0, 2, 3, 1))  # torchvision keeps NCHW
    return RawDataset("svhn", nhwc(train.data), labels, nhwc(test.data), np.asarray(test.labels, dtype=np.int64),
                      [str(i) for i in range(10)], mean, std, False, _fingerprint("svhn", labels))


@register_dataset("digits")
def _load_digits(cfg: "DataConfig") -> RawDataset:
    """scikit-learn's 1,797 8x8 digits (0..16), as 32x32 RGB uint8. No files, no network, no test split."""
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.from_numpy(d.images).float()[:, None] * (255.0 / 16.0)                # (N, 1, 8, 8)
    x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
    x = x.round().clamp(0, 255).to(torch.uint8).expand(-1, 3, -1, -1)              # (N, 3, 32, 32)
    images = x.permute(0, 2, 3, 1).contiguous().numpy()                            # (N, 32, 32, 3)
    labels = np.asarray(d.target, dtype=np.int64)
    mean, std = _channel_stats(images)
    return RawDataset("digits", images, labels, None, None, [str(i) for i in range(10)], mean, std, False,
                      _fingerprint("digits", labels))


@register_dataset("imagefolder")
def _load_imagefolder(cfg: "DataConfig") -> RawDataset:
    """An ImageFolder tree (class subfolders, or train/ + optional test/ or val/), or a .zip of one.

    Small images (all <= 64 px, or ``pipeline='device'``) are decoded once into a uint8 array and
    cached as .npz under $COWTUNE_CACHE (default ~/.cache/cowtune). Large ones stay files.
    """
    root = os.path.abspath(os.path.expanduser(cfg.root))
    names = _list_images(root, cfg.root)
    train, test, classes = _layout(names, cfg.root)
    index = {c: i for i, c in enumerate(classes)}
    train_files = FileImages(root, np.array([n for n, _, _ in train]))
    train_labels = np.array([index[c] for _, c, _ in train], dtype=np.int64)
    test_files = FileImages(root, np.array([n for n, _, _ in test])) if test else None
    test_labels = np.array([index[c] for _, c, _ in test], dtype=np.int64) if test else None
    fingerprint = _fingerprint("imagefolder", train_labels, "\n".join(k for _, _, k in train))
    w, h = train_files.open(0).size
    small = cfg.pipeline == "device" or (cfg.pipeline == "auto" and max(w, h) <= SMALL_IMAGE_MAX)
    if not small:
        mean, std = NORMALISATION["imagenet"]
        return RawDataset("imagefolder", train_files, train_labels, test_files, test_labels, classes,
                          mean, std, True, fingerprint)
    arrays = _decode_cached(root, cfg.root, train_files, test_files)
    return RawDataset("imagefolder", arrays["train"], train_labels, arrays.get("test"), test_labels, classes,
                      tuple(arrays["mean"].tolist()), tuple(arrays["std"].tolist()), True, fingerprint)


# ---------------------------------------------------------------------------------------------
# ImageFolder trees and zips
# ---------------------------------------------------------------------------------------------

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


def _list_images(root: str, shown: str) -> list[str]:
    """Relative paths (with '/') of the image files under a folder or inside a .zip, sorted."""
    if os.path.isdir(root):
        out = []
        for d, _, files in os.walk(root, followlinks=True):
            rel = os.path.relpath(d, root)
            out += [f if rel == "." else f"{rel}/{f}".replace(os.sep, "/") for f in files]
    elif os.path.isfile(root) and zipfile.is_zipfile(root):
        out = _zip_handle(root).namelist()
    else:
        raise ConfigError(f"data.root must be an ImageFolder tree or a .zip of one, got {shown!r} (not found)")
    out = sorted(n for n in out if _is_image(n))
    check(len(out) > 0, "data.root", f"hold image files ({', '.join(_IMAGE_EXTS)}) in class folders", shown)
    return out


def _layout(names: list[str], shown: str) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]], list[str]]:
    """Split image paths into train and test entries (name, class, key) and the sorted class names.

    A common leading folder (e.g. a zip wrapping the tree) is skipped. With a ``train/`` folder,
    ``test/`` (else ``val/``) is the test split; otherwise every first-level folder is a class.
    ``key`` is the path below the skipped prefix: the same tree as a folder or a zip gives the same keys.
    """
    parts = [n.split("/") for n in names]
    while (all(len(p) >= 3 for p in parts) and len({p[0] for p in parts}) == 1
           and parts[0][0] not in _SPLIT_DIRS):
        parts = [p[1:] for p in parts]
    entries = [(n, p) for n, p in zip(names, parts) if len(p) >= 2]
    if any(p[0] == "train" and len(p) >= 3 for _, p in entries):
        test_dir = "test" if any(p[0] == "test" for _, p in entries) else "val"
        pick = lambda split: [(n, p[1], "/".join(p)) for n, p in entries if p[0] == split and len(p) >= 3]
        train, test = pick("train"), pick(test_dir)
    else:
        train, test = [(n, p[0], "/".join(p)) for n, p in entries], []
    check(len(train) > 0, "data.root", "hold images in class folders (<root>/<class>/<image>)", shown)
    classes = sorted({c for _, c, _ in train})
    extra = sorted({c for _, c, _ in test} - set(classes))
    check(not extra, "data.root", f"have no test classes missing from train ({', '.join(extra)})", shown)
    return train, test, classes


def _cache_dir() -> Path:
    return Path(os.environ.get("COWTUNE_CACHE") or Path.home() / ".cache" / "cowtune")


def _source_key(root: str, files: Sequence[FileImages | None]) -> str:
    """Cache key: absolute path, size and mtime of the zip, or of every listed file of a folder."""
    st = os.stat(root)
    h = hashlib.sha256(f"v{_CACHE_VERSION}|{root}|{st.st_size}|{st.st_mtime_ns}".encode())
    if os.path.isdir(root):
        for fi in files:
            for name in (fi.names if fi is not None else ()):
                s = os.stat(os.path.join(root, str(name)))
                h.update(f"|{name}|{s.st_size}|{s.st_mtime_ns}".encode())
    for fi in files:
        h.update(f"|split:{len(fi) if fi is not None else -1}".encode())
    return h.hexdigest()[:24]


def _decode_cached(root: str, shown: str, train: FileImages, test: FileImages | None) -> dict[str, np.ndarray]:
    """Decode every image to uint8 (N, H, W, 3) once; later calls read the .npz cache.

    Returns {"train": ..., "test": ... (when there is a test split), "mean": (3,), "std": (3,)}.
    """
    path = _cache_dir() / f"imagefolder-{_source_key(root, (train, test))}.npz"
    if path.exists():
        t0 = time.perf_counter()
        with np.load(path, allow_pickle=False) as z:
            out = {k: z[k] for k in z.files}
        print(f"data: loaded {len(out['train'])} decoded images of {shown} from cache {path} "
              f"in {time.perf_counter() - t0:.1f} s", flush=True)
        return out
    t0 = time.perf_counter()
    out = {"train": _decode_all(train, shown)}
    if test is not None:
        out["test"] = _decode_all(test, shown)
        check(out["test"].shape[1:] == out["train"].shape[1:], "data.root",
              "hold test images of the training image size", shown)
    mean, std = _channel_stats(out["train"])
    out["mean"], out["std"] = np.array(mean), np.array(std)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
    np.savez(tmp, **out)
    os.replace(tmp, path)  # atomic: concurrent trials never read a half-written cache
    n = len(out["train"]) + (len(out["test"]) if test is not None else 0)
    print(f"data: decoded {n} images of {shown} in {time.perf_counter() - t0:.1f} s, cached to {path}", flush=True)
    return out


def _decode_all(files: FileImages, shown: str) -> np.ndarray:
    """(N, H, W, 3) uint8; every image must have the first image's size."""
    first = np.asarray(files.load(0))
    out = np.empty((len(files),) + first.shape, dtype=np.uint8)
    out[0] = first
    for i in range(1, len(files)):
        img = files.load(i)
        if img.size != (first.shape[1], first.shape[0]):
            raise ConfigError(
                f"data.root must hold images of one size for the device pipeline (first is "
                f"{first.shape[1]}x{first.shape[0]}, {files.names[i]} is {img.size[0]}x{img.size[1]}); "
                f"use --set data.pipeline=loader for mixed sizes, got {shown!r}")
        out[i] = np.asarray(img)
    return out


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


def _fingerprint(name: str, labels: np.ndarray, extra: str = "") -> str:
    h = hashlib.sha256(np.ascontiguousarray(labels, dtype="<i8").tobytes() + extra.encode())
    return f"{name}|n={len(labels)}|{h.hexdigest()[:16]}"


# ---------------------------------------------------------------------------------------------
# Splits
# ---------------------------------------------------------------------------------------------

def make_splits(labels: np.ndarray, n_val: int, val_seed: int, n_labeled: int, labeled_seed: int,
                fingerprint: str = "") -> Splits:
    """Validation holdout, then a labeled subset of the rest, both stratified (reference 4.1).

    Args:
        labels: (N,) int train labels.
        n_val: holdout size (0 = none), drawn with StratifiedShuffleSplit(random_state=val_seed).
        n_labeled: labeled subset of the remainder (-1 = all of it), random_state=labeled_seed.
        fingerprint: dataset identity mixed into the hashes.
    Returns:
        Splits with sorted int64 indices; unlabeled = every non-validation index.
    Raises:
        ConfigError naming data.n_val or data.n_labeled when the sizes cannot work.
    """
    from sklearn.model_selection import StratifiedShuffleSplit

    labels = np.asarray(labels, dtype=np.int64)
    n, k = len(labels), len(np.unique(labels))
    check(n_val < n, "data.n_val", f"be smaller than the training split ({n} images)", n_val)
    check(n_val == 0 or n_val >= k, "data.n_val", f"be 0 or at least the number of classes ({k})", n_val)
    check(n - n_val >= k, "data.n_val", f"leave at least one training image per class ({n} images, {k} classes)",
          n_val)
    rest_n = n - n_val
    check(n_labeled == -1 or n_labeled <= rest_n, "data.n_labeled",
          f"be at most the {rest_n} images left after the validation holdout of {n_val} (or -1 for all)", n_labeled)
    check(n_labeled == -1 or n_labeled >= k, "data.n_labeled",
          f"be at least the number of classes ({k}); fewer gives fewer than one label per class", n_labeled)
    check(n_labeled in (-1, rest_n) or rest_n - n_labeled >= k, "data.n_labeled",
          f"be -1, all {rest_n} remaining images, or at most {rest_n - k} (a stratified subset leaves "
          f"at least one image per class out)", n_labeled)
    everything = np.arange(n, dtype=np.int64)
    val, rest = everything[:0], everything
    if n_val > 0:
        rest_pos, val_pos = _stratified(StratifiedShuffleSplit, labels, n_val, val_seed, "data.n_val")
        val, rest = everything[val_pos], everything[rest_pos]
    labeled = rest
    if n_labeled not in (-1, rest_n):
        labeled = rest[_stratified(StratifiedShuffleSplit, labels[rest], n_labeled, labeled_seed, "data.n_labeled")[1]]
    val, labeled, unlabeled = np.sort(val), np.sort(labeled), np.sort(rest)
    hashes = {name: _split_hash(idx, fingerprint) for name, idx in
              (("val", val), ("labeled", labeled), ("unlabeled", unlabeled))}
    return Splits(val, labeled, unlabeled, hashes)


def _stratified(sss: type, labels: np.ndarray, size: int, seed: int, field: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        return next(sss(n_splits=1, test_size=size, random_state=seed).split(np.zeros(len(labels)), labels))
    except ValueError as exc:  # e.g. a class with a single image
        raise ConfigError(f"{field} must allow a stratified split of these labels, got {size!r} ({exc})") from None


def _split_hash(indices: np.ndarray, fingerprint: str) -> str:
    h = hashlib.sha256(fingerprint.encode() + b"\0" + np.ascontiguousarray(indices, dtype="<i8").tobytes())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Randomness and augmentation helpers (device side, vectorised over the batch)
# ---------------------------------------------------------------------------------------------

def stream_seed(seed: int, epoch: int, stream: str) -> int:
    """A 63-bit seed for one named random stream of one epoch (sha256, so streams never collide)."""
    digest = hashlib.sha256(f"cowtune-data|{seed}|{epoch}|{stream}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _generator(seed: int, epoch: int, stream: str, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(stream_seed(seed, epoch, stream))


def epoch_order(pool: Tensor, count: int, gen: torch.Generator) -> Tensor:
    """(count,) indices: concatenated uniform random permutations of ``pool`` (n,), cut to count.

    All permutations come from one sort of (reps, n) float64 uniforms: no Python loop per
    permutation (a 10-label set is cycled thousands of times per epoch).
    """
    reps = -(-count // len(pool))
    keys = torch.rand((reps, len(pool)), generator=gen, device=pool.device, dtype=torch.float64)
    return pool[keys.argsort(dim=1, stable=True)].flatten()[:count]


def crop_flip_params(shape: tuple[int, ...], pad: int, flip: bool,
                     gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Random crop offsets oy, ox in [0, 2*pad] and flips in {0, 1}, each int64 of ``shape``."""
    dev = gen.device
    oy = torch.randint(0, 2 * pad + 1, shape, generator=gen, device=dev)
    ox = torch.randint(0, 2 * pad + 1, shape, generator=gen, device=dev)
    flips = torch.randint(0, 2, shape, generator=gen, device=dev) if flip else torch.zeros_like(oy)
    return oy, ox, flips


def window_indices(offset: Tensor, size: int, pad: int, flipped: Tensor | None = None) -> Tensor:
    """Source coordinates (..., size) of a crop window at ``offset`` in the reflect-padded axis.

    Position j of the window reads padded coordinate offset + j, i.e. source offset + j - pad,
    mirrored at the borders without repeating the edge (``F.pad(mode='reflect')``). A flipped
    window reads its positions in reverse. Requires pad < size.
    """
    src = offset[..., None] + torch.arange(size, device=offset.device) - pad
    src = src.abs()
    src = torch.where(src > size - 1, 2 * (size - 1) - src, src)
    if flipped is not None:
        src = torch.where(flipped[..., None].bool(), src.flip(-1), src)
    return src


def gather_crops(images: Tensor, idx: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """Gather crops in one indexing kernel.

    Args:
        images: (N, C, H, W) contiguous. idx: (B,) image indices.
        rows: (B, h) source rows per output row. cols: (B, w) source columns per output column.
    Returns:
        (B, C, h, w) with out[b, c, i, j] = images[idx[b], c, rows[b, i], cols[b, j]].
    """
    _, c, h, w = images.shape
    chan = torch.arange(c, device=images.device)
    flat = ((idx[:, None, None, None] * c + chan[None, :, None, None]) * h + rows[:, None, :, None]) * w \
        + cols[:, None, None, :]                                                  # (B, C, h, w)
    return images.view(-1)[flat]


def _norm_constants(mean: Sequence[float], std: Sequence[float], device: torch.device) -> tuple[Tensor, Tensor]:
    """scale, shift of shape (1, C, 1, 1) with x * scale + shift == (x / 255 - mean) / std."""
    m = torch.tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1)
    return 1.0 / (255.0 * s), -m / s


def normalise(x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """uint8 (B, C, H, W) -> float32 (B, C, H, W) normalised (see ``_norm_constants``)."""
    return x.float().mul_(scale).add_(shift)


# ---------------------------------------------------------------------------------------------
# DeviceData: the whole dataset on the training device
# ---------------------------------------------------------------------------------------------

class DeviceData:
    """Small images, decoded once and kept on ``device`` as uint8 (N, C, H, W).

    A training view is reflect pad ``pad`` + random crop back to H x W + optional flip, done as
    one gather per batch, then normalised. No host syncs inside ``train_batches``.
    """

    def __init__(self, raw: RawDataset, splits: Splits, flip: bool, pad: int, device: torch.device,
                 image_size: int | None = None):
        self.name, self.device, self.flip, self.pad, self.splits = raw.name, device, flip, pad, splits
        self.images = _to_device_nchw(raw.train_images, image_size, device)            # (N, C, H, W) uint8
        self.test_images = None if raw.test_images is None else _to_device_nchw(raw.test_images, image_size, device)
        self.labels = torch.from_numpy(raw.train_labels).to(device)
        self.test_labels = None if raw.test_labels is None else torch.from_numpy(raw.test_labels).to(device)
        c, h, w = self.images.shape[1:]
        check(pad < min(h, w), "data.pad", f"be smaller than the image side ({min(h, w)})", pad)
        self._index = {k: torch.from_numpy(getattr(splits, k)).to(device) for k in ("val", "labeled", "unlabeled")}
        self._scale, self._shift = _norm_constants(raw.mean, raw.std, device)
        self.num_classes, self.class_names = len(raw.class_names), list(raw.class_names)
        self.image_shape = (int(c), int(h), int(w))
        self.sizes = _sizes(raw, splits)
        self.split_hashes = dict(splits.hashes)

    def default_steps_per_epoch(self, batch_size: int) -> int:
        return max(1, self.sizes["unlabeled"] // batch_size)

    def train_batches(self, epoch: int, seed: int, batch_size: int, steps: int,
                      augment_twice: bool) -> Iterator[Batch]:
        """``steps`` batches of ``batch_size`` labeled and unlabeled images for this (epoch, seed)."""
        _check_batching(batch_size, steps)
        n, dev = steps * batch_size, self.device
        sup = epoch_order(self._index["labeled"], n, _generator(seed, epoch, "labeled", dev))
        unsup = epoch_order(self._index["unlabeled"], n, _generator(seed, epoch, "unlabeled", dev))
        views = 3 if augment_twice else 2
        params = crop_flip_params((views, steps, batch_size), self.pad, self.flip,
                                  _generator(seed, epoch, "augment", dev))        # 3 x (views, steps, B)
        sup, unsup = sup.view(steps, batch_size), unsup.view(steps, batch_size)
        return self._iterate(sup, self.labels[sup], unsup, params, augment_twice)

    def _iterate(self, sup: Tensor, y: Tensor, unsup: Tensor, params: tuple[Tensor, Tensor, Tensor],
                 augment_twice: bool) -> Iterator[Batch]:
        for s in range(sup.shape[0]):
            x_sup = self._augment(sup[s], *(p[0, s] for p in params))
            x_u0 = self._augment(unsup[s], *(p[1, s] for p in params))
            x_u1 = self._augment(unsup[s], *(p[2, s] for p in params)) if augment_twice else x_u0
            yield Batch(x_sup, y[s], x_u0, x_u1)

    def _augment(self, idx: Tensor, oy: Tensor, ox: Tensor, flips: Tensor) -> Tensor:
        """(B,) indices and per-sample params -> (B, C, H, W) float32 normalised views."""
        _, _, h, w = self.images.shape
        rows = window_indices(oy, h, self.pad)                                      # (B, H)
        cols = window_indices(ox, w, self.pad, flips)                               # (B, W)
        return normalise(gather_crops(self.images, idx, rows, cols), self._scale, self._shift)

    def eval_batches(self, split: str, batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
        """(x (b, C, H, W) float32 normalised, y (b,) int64) in index order; the last batch may be short."""
        images, labels, idx = self._eval_source(split)
        check(batch_size >= 1, "batch_size", "be >= 1", batch_size)
        return ((normalise(images[idx[i:i + batch_size]], self._scale, self._shift), labels[idx[i:i + batch_size]])
                for i in range(0, len(idx), batch_size))

    def _eval_source(self, split: str) -> tuple[Tensor, Tensor, Tensor]:
        _check_eval_split(split, self.sizes)
        if split == "val":
            return self.images, self.labels, self._index["val"]
        return self.test_images, self.test_labels, torch.arange(len(self.test_labels), device=self.device)

    def describe(self) -> str:
        c, h, w = self.image_shape
        aug = f"reflect pad {self.pad} + random crop{' + flip' if self.flip else ''}"
        return f"{self.name}: {_describe_sizes(self.sizes)}, {c}x{h}x{w}, device pipeline on {self.device} ({aug})"


def _to_device_nchw(images: np.ndarray, size: int | None, device: torch.device) -> Tensor:
    """uint8 (N, H, W, C) array -> contiguous uint8 (N, C, H, W) on device, resized once if asked."""
    x = torch.from_numpy(np.ascontiguousarray(images)).to(device).permute(0, 3, 1, 2).contiguous()
    if size is None or x.shape[-2:] == (size, size):
        return x
    chunks = [F.interpolate(x[i:i + 4096].float(), size=(size, size), mode="bilinear", antialias=True,
                            align_corners=False).round_().clamp_(0, 255).to(torch.uint8)
              for i in range(0, len(x), 4096)]
    return torch.cat(chunks)


def _sizes(raw: RawDataset, splits: Splits) -> dict[str, int]:
    return {"train": len(raw.train_labels), "val": len(splits.val), "labeled": len(splits.labeled),
            "unlabeled": len(splits.unlabeled), "test": 0 if raw.test_labels is None else len(raw.test_labels)}


def _describe_sizes(sizes: dict[str, int]) -> str:
    return (f"train {sizes['train']} (val {sizes['val']}, labeled {sizes['labeled']}, "
            f"unlabeled {sizes['unlabeled']}), test {sizes['test']}")


def _check_batching(batch_size: int, steps: int) -> None:
    check(batch_size >= 1, "batch_size", "be >= 1", batch_size)
    check(steps >= 1, "steps", "be >= 1", steps)


def _check_eval_split(split: str, sizes: dict[str, int]) -> None:
    check(split in ("val", "test"), "data.eval_split", "be 'val' or 'test'", split)
    check(split != "val" or sizes["val"] > 0, "data.eval_split",
          "be 'test' when data.n_val is 0 (there is no holdout)", split)
    check(split != "test" or sizes["test"] > 0, "data.eval_split",
          "be 'val' for a dataset without a test split", split)


# ---------------------------------------------------------------------------------------------
# LoaderData: large images read lazily by DataLoader workers
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class _ArrayImages:
    """uint8 (N, H, W, C) array with the ``FileImages.load`` interface."""
    array: np.ndarray

    def __len__(self) -> int:
        return len(self.array)

    def load(self, i: int) -> Image.Image:
        return Image.fromarray(self.array[i]).convert("RGB")


def _uniform(gen: torch.Generator, low: float, high: float) -> float:
    return low + (high - low) * float(torch.rand((), generator=gen, dtype=torch.float64))


def _randint(gen: torch.Generator, high: int) -> int:
    return int(torch.randint(0, high, (), generator=gen))


def inception_box(width: int, height: int, gen: torch.Generator) -> tuple[int, int, int, int]:
    """Random (left, top, right, bottom) covering 5..100% of the area with aspect ratio 3/4..4/3.

    Ten attempts as torchvision's RandomResizedCrop; the fallback is the whole image (as TF's
    sample_distorted_bounding_box in the reference).
    """
    area = width * height
    for _ in range(10):
        target = area * _uniform(gen, *INCEPTION_SCALE)
        aspect = math.exp(_uniform(gen, math.log(INCEPTION_RATIO[0]), math.log(INCEPTION_RATIO[1])))
        cw, ch = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < cw <= width and 0 < ch <= height:
            left, top = _randint(gen, width - cw + 1), _randint(gen, height - ch + 1)
            return left, top, left + cw, top + ch
    return 0, 0, width, height


def _colour_jitter(img: Image.Image, gen: torch.Generator) -> Image.Image:
    """Saturation 0.7..1.4, hue +-0.1, contrast 0.7..1.4, brightness 0.6..1.4, in a random order.

    Brightness uses torchvision's multiplicative meaning of 0.4; the reference adds +-0.4 on the
    0..255 scale, which is practically a no-op (reference 4.2).
    """
    import torchvision.transforms.functional as TF
    ops = [lambda im: TF.adjust_saturation(im, _uniform(gen, 0.7, 1.4)),
           lambda im: TF.adjust_hue(im, _uniform(gen, -0.1, 0.1)),
           lambda im: TF.adjust_contrast(im, _uniform(gen, 0.7, 1.4)),
           lambda im: TF.adjust_brightness(im, _uniform(gen, 0.6, 1.4))]
    for i in torch.randperm(4, generator=gen).tolist():
        img = ops[i](img)
    return img


def _pil_to_uint8(img: Image.Image) -> Tensor:
    return torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1).contiguous()   # (3, S, S)


def train_view(img: Image.Image, size: int, flip: bool, jitter: bool, gen: torch.Generator) -> Tensor:
    """Inception crop resized to size x size (bicubic), flip, optional jitter -> uint8 (3, size, size)."""
    box = inception_box(img.width, img.height, gen)
    img = img.resize((size, size), Image.BICUBIC, box=box)
    if flip and _randint(gen, 2):
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    if jitter:
        img = _colour_jitter(img, gen)
    return _pil_to_uint8(img)


def eval_view(img: Image.Image, size: int) -> Tensor:
    """Centre square of 0.875 x short side, resized to size x size (bicubic) -> uint8 (3, size, size).

    Equal to "resize the short side to size / 0.875, centre-crop size" but with one resampling.
    """
    side = EVAL_CROP * min(img.width, img.height)
    left, top = (img.width - side) / 2, (img.height - side) / 2
    return _pil_to_uint8(img.resize((size, size), Image.BICUBIC, box=(left, top, left + side, top + side)))


_GOLDEN = 0x9E3779B97F4A7C15  # spreads per-sample seeds of one epoch over the 63-bit range


class _TrainItems(torch.utils.data.Dataset):
    """Item (sup index, unsup index, sample seed, twice) -> (sup uint8, label, unsup0, unsup1 or empty)."""

    def __init__(self, images, labels: np.ndarray, size: int, flip: bool, jitter: bool):
        self.images, self.labels, self.size, self.flip, self.jitter = images, labels, size, flip, jitter

    def __getitem__(self, item: tuple[int, int, int, bool]) -> tuple[Tensor, int, Tensor, Tensor]:
        sup_i, unsup_i, sample_seed, twice = item
        gen = torch.Generator().manual_seed(sample_seed)  # one per sample: independent of worker count
        view = lambda img: train_view(img, self.size, self.flip, self.jitter, gen)
        x_sup = view(self.images.load(sup_i))
        unsup = self.images.load(unsup_i)
        x_u0 = view(unsup)
        x_u1 = view(unsup) if twice else torch.empty(0, dtype=torch.uint8)
        return x_sup, int(self.labels[sup_i]), x_u0, x_u1


class _EvalItems(torch.utils.data.Dataset):
    """Item (split, index) -> (eval view uint8 (3, S, S), label)."""

    def __init__(self, sources: dict, size: int):
        self.sources, self.size = sources, size    # split -> (images, labels)

    def __getitem__(self, item: tuple[str, int]) -> tuple[Tensor, int]:
        images, labels = self.sources[item[0]]
        return eval_view(images.load(item[1]), self.size), int(labels[item[1]])


class _Batches(torch.utils.data.Sampler):
    """A batch sampler whose batches are replaced before each pass (so workers can persist)."""

    def __init__(self) -> None:
        self.make: Callable[[], Iterator[list]] = lambda: iter(())
        self.count = 0

    def __iter__(self) -> Iterator[list]:
        return self.make()

    def __len__(self) -> int:
        return self.count


class LoaderData:
    """Large images read lazily by DataLoader workers; uint8 batches are normalised on the device.

    Training view: inception crop to ``image_size`` (bicubic) + flip (+ colour jitter). Every
    sample's augmentation has its own generator seeded from (seed, epoch, position in epoch), so
    batches do not depend on the number of workers.
    """

    def __init__(self, raw: RawDataset, splits: Splits, flip: bool, image_size: int, colour_jitter: bool,
                 workers: int, device: torch.device):
        self.name, self.device, self.flip, self.splits = raw.name, device, flip, splits
        self.image_size, self.colour_jitter, self.workers = image_size, colour_jitter, workers
        wrap = lambda im: im if isinstance(im, FileImages) else _ArrayImages(im)
        self._train = _TrainItems(wrap(raw.train_images), raw.train_labels, image_size, flip, colour_jitter)
        sources = {"val": (wrap(raw.train_images), raw.train_labels)}
        if raw.test_images is not None:
            sources["test"] = (wrap(raw.test_images), raw.test_labels)
        self._eval = _EvalItems(sources, image_size)
        self._loaders: dict[str, tuple[torch.utils.data.DataLoader, _Batches]] = {}
        self._scale, self._shift = _norm_constants(raw.mean, raw.std, device)
        self.num_classes, self.class_names = len(raw.class_names), list(raw.class_names)
        self.image_shape = (3, image_size, image_size)
        self.sizes = _sizes(raw, splits)
        self.split_hashes = dict(splits.hashes)

    def default_steps_per_epoch(self, batch_size: int) -> int:
        return max(1, self.sizes["unlabeled"] // batch_size)

    def _loader(self, role: str) -> tuple[torch.utils.data.DataLoader, _Batches]:
        """One DataLoader per role ('train', 'eval'), created on first use; workers persist."""
        if role not in self._loaders:
            sampler = _Batches()
            loader = torch.utils.data.DataLoader(
                self._train if role == "train" else self._eval, batch_sampler=sampler, num_workers=self.workers,
                pin_memory=self.device.type == "cuda", persistent_workers=self.workers > 0)
            self._loaders[role] = (loader, sampler)
        return self._loaders[role]

    def train_batches(self, epoch: int, seed: int, batch_size: int, steps: int,
                      augment_twice: bool) -> Iterator[Batch]:
        """As ``DeviceData.train_batches``; the order is drawn on the host (the workers need it there)."""
        _check_batching(batch_size, steps)
        n, cpu = steps * batch_size, torch.device("cpu")
        order = lambda pool, stream: epoch_order(torch.from_numpy(pool), n,
                                                 _generator(seed, epoch, stream, cpu)).numpy()
        sup, unsup = order(self.splits.labeled, "labeled"), order(self.splits.unlabeled, "unlabeled")
        base = stream_seed(seed, epoch, "augment")

        def batches() -> Iterator[list]:
            for s in range(steps):
                yield [(int(sup[j]), int(unsup[j]), (base + j * _GOLDEN) % (1 << 63), augment_twice)
                       for j in range(s * batch_size, (s + 1) * batch_size)]
        loader, sampler = self._loader("train")
        sampler.make, sampler.count = batches, steps
        return self._iterate_train(loader, augment_twice)

    def _iterate_train(self, loader: torch.utils.data.DataLoader, augment_twice: bool) -> Iterator[Batch]:
        for x_sup, y_sup, x_u0, x_u1 in loader:
            x_u0 = self._to_device(x_u0)
            yield Batch(self._to_device(x_sup), y_sup.to(self.device, non_blocking=True), x_u0,
                        self._to_device(x_u1) if augment_twice else x_u0)

    def _to_device(self, x: Tensor) -> Tensor:
        return normalise(x.to(self.device, non_blocking=True), self._scale, self._shift)

    def eval_batches(self, split: str, batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
        """(x (b, 3, S, S) float32 normalised, y (b,) int64) in index order; the last batch may be short."""
        _check_eval_split(split, self.sizes)
        check(batch_size >= 1, "batch_size", "be >= 1", batch_size)
        idx = self.splits.val if split == "val" else np.arange(self.sizes["test"])
        loader, sampler = self._loader("eval")
        sampler.make = lambda: ([(split, int(i)) for i in idx[s:s + batch_size]]
                                for s in range(0, len(idx), batch_size))
        sampler.count = -(-len(idx) // batch_size)
        return ((self._to_device(x), y.to(self.device, non_blocking=True)) for x, y in loader)

    def describe(self) -> str:
        aug = f"inception crop {self.image_size}{' + flip' if self.flip else ''}" \
              f"{' + colour jitter' if self.colour_jitter else ''}"
        return (f"{self.name}: {_describe_sizes(self.sizes)}, 3x{self.image_size}x{self.image_size}, "
                f"loader pipeline ({self.workers} workers) to {self.device} ({aug})")


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------

def prepare_data(cfg: "DataConfig", labeled_seed: int, device: torch.device) -> TrainData:
    """Load ``cfg.dataset``, split it and return the pipeline for ``device``.

    Args:
        cfg: the data config. labeled_seed: seed of the labeled subset (``TrainConfig.labeled_seed``).
        device: the training device; batches are returned there.
    Raises:
        ConfigError naming the data.* field at fault (unknown dataset, missing files, bad sizes).
    """
    device = torch.device(device)
    raw = load_raw(cfg)
    flip = raw.flip if cfg.flip is None else cfg.flip
    splits = make_splits(raw.train_labels, cfg.n_val, cfg.val_seed, cfg.n_labeled, labeled_seed, raw.fingerprint)
    check(cfg.eval_split != "test" or raw.test_labels is not None, "data.eval_split",
          f"be 'val' for dataset '{cfg.dataset}' (it has no test split)", cfg.eval_split)
    on_device = isinstance(raw.train_images, np.ndarray) and cfg.pipeline != "loader"
    if on_device:
        return DeviceData(raw, splits, flip, cfg.pad, device, cfg.image_size)
    if isinstance(raw.train_images, np.ndarray):
        size = cfg.image_size or raw.train_images.shape[1]   # in-memory small images: native size
    else:
        size = cfg.image_size or LOADER_IMAGE_SIZE
    return LoaderData(raw, splits, flip, size, cfg.colour_jitter, cfg.workers, device)
