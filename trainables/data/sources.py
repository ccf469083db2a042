"""Datasets as loaders return them (``RawDataset``), the ``DATASETS`` registry and its loaders
(cifar10, cifar100, svhn, digits, imagefolder), and the cheap driver-side checks ``check_source``
and ``train_size`` that read no image.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
import torch.nn.functional as F

from trainables.data.image_files import (FileImages, _channel_stats, _decode_cached, _layout, _list_images,
                                        first_readable)
from trainables.data.splits import _fingerprint
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


def check_dataset(name: str) -> None:
    """Raises ConfigError, listing the known names and the closest, unless ``name`` is a registered dataset."""
    if name not in DATASETS:
        raise unknown_name("dataset", name, DATASETS)


def load_raw(cfg: "DataConfig") -> RawDataset:
    """Load ``cfg.dataset`` through its registered loader. Raises ConfigError for unknown names."""
    check_dataset(cfg.dataset)
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


TRAIN_SIZES = {"cifar10": 50000, "cifar100": 50000, "svhn": 73257, "digits": 1797}


def check_source(cfg: "DataConfig") -> int | None:
    """Cheap check that ``cfg`` names data a loader can read, for a driver before it starts workers.

    Lists an ImageFolder tree or zip (no decoding) or looks for torchvision's files; raises ConfigError.
    Returns the number of training images (None where only the loader can tell).
    """
    check_dataset(cfg.dataset)
    root = os.path.abspath(os.path.expanduser(cfg.root))
    if cfg.dataset == "imagefolder":
        return len(_layout(_list_images(root, cfg.root, broken=cfg.unreadable), cfg.root)[0])
    if cfg.dataset in TORCHVISION_FILES and not cfg.download:
        if not os.path.exists(os.path.join(root, TORCHVISION_FILES[cfg.dataset])):
            raise _missing_files_error(cfg)
    return TRAIN_SIZES.get(cfg.dataset)


def has_test_split(cfg: "DataConfig") -> bool | None:
    """Whether the data ``cfg`` names has a test split, found without decoding (an ImageFolder tree or zip is
    listed); None where only the loader can tell (a dataset registered elsewhere)."""
    if cfg.dataset in TORCHVISION_FILES:
        return True
    if cfg.dataset == "digits":
        return False
    if cfg.dataset == "imagefolder":
        root = os.path.abspath(os.path.expanduser(cfg.root))
        return len(_layout(_list_images(root, cfg.root, broken=cfg.unreadable), cfg.root)[1]) > 0
    return None


def train_size(cfg: "DataConfig") -> int | None:
    """Number of training images ``cfg`` names, without decoding any; None when it cannot tell."""
    if cfg.dataset in TRAIN_SIZES:
        return TRAIN_SIZES[cfg.dataset]   # known, also before a download
    try:
        return check_source(cfg)
    except ConfigError:
        return None


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
    names = _list_images(root, cfg.root, broken=cfg.unreadable)
    train, test, classes = _layout(names, cfg.root)
    index = {c: i for i, c in enumerate(classes)}
    train_files = FileImages(root, np.array([n for n, _, _ in train]))
    train_labels = np.array([index[c] for _, c, _ in train], dtype=np.int64)
    test_files = FileImages(root, np.array([n for n, _, _ in test])) if test else None
    test_labels = np.array([index[c] for _, c, _ in test], dtype=np.int64) if test else None
    skip = cfg.unreadable == "skip"
    _, (w, h) = first_readable(train_files, cfg.root, skip)
    small = cfg.pipeline == "device" or (cfg.pipeline == "auto" and max(w, h) <= SMALL_IMAGE_MAX)
    if not small:
        check(not skip, "data.unreadable", "be 'stop' for large images read during training (data.pipeline "
              "loader): remove the files that cannot be decoded", cfg.unreadable)
        mean, std = NORMALISATION["imagenet"]
        return RawDataset("imagefolder", train_files, train_labels, test_files, test_labels, classes,
                          mean, std, True, _fingerprint("imagefolder", train_labels, "\n".join(k for _, _, k in train)))
    arrays = _decode_cached(root, cfg.root, train_files, test_files, skip)
    if skip:   # the files left out, out of the labels (and the fingerprint) too
        train_labels, train = train_labels[arrays["train_kept"]], [train[i] for i in arrays["train_kept"]]
        test_labels = test_labels[arrays["test_kept"]] if test_labels is not None else None
    fingerprint = _fingerprint("imagefolder", train_labels, "\n".join(k for _, _, k in train))
    return RawDataset("imagefolder", arrays["train"], train_labels, arrays.get("test"), test_labels, classes,
                      tuple(arrays["mean"].tolist()), tuple(arrays["std"].tolist()), True, fingerprint)
