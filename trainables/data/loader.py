"""``LoaderData``: large images (ImageFolder/ImageNet layout) read lazily by DataLoader workers.

Inception crop + flip (+ colour jitter) per sample on the host, as in the reference ImageNet
pipeline (arXiv:2003.12022, section 4.2); uint8 batches are normalised on the device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from trainables.data.batches import (Batch, _check_batching, _check_eval_split, _describe_sizes, _generator,
                                     eval_starts, _norm_constants, _sizes, epoch_order, normalise, stream_seed)
from trainables.data.image_files import FileImages
from trainables.validation import check

if TYPE_CHECKING:
    from trainables.data.sources import RawDataset
    from trainables.data.splits import Splits

LOADER_IMAGE_SIZE = 224       # default training crop of the loader pipeline for files
INCEPTION_SCALE = (0.05, 1.0)  # area fraction of the inception crop (reference 4.2) ...
INCEPTION_RATIO = (0.75, 1.33)  # ... aspect ratio (width / height), drawn uniformly as TF does
INCEPTION_ATTEMPTS = 100       # then the whole image
INCEPTION_MIN_COVERED = 0.1    # TF's min_object_covered of the whole-image box: crops below 10% are redrawn
EVAL_CROP = 0.875             # eval: centre crop of 0.875 x short side, resized to image_size


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
    """Random (left, top, right, bottom): TF's ``sample_distorted_bounding_box`` as the reference calls it
    (reference 4.2), one image at a time.

    The whole image is the object box; per attempt an aspect ratio uniform in 0.75..1.33, a height uniform
    among those whose area lies in 5..100% of the image, kept if it fits and covers at least 10% of the image
    (``min_object_covered`` 0.1); 100 attempts, then the whole image. ``gpu_decode.inception_boxes`` is the same
    rule for a batch of tensors.
    """
    area = width * height
    min_area, max_area = INCEPTION_SCALE[0] * area, INCEPTION_SCALE[1] * area
    for _ in range(INCEPTION_ATTEMPTS):
        ar = _uniform(gen, *INCEPTION_RATIO)
        ch, max_h = round(math.sqrt(min_area / ar)), round(math.sqrt(max_area / ar))
        if round(max_h * ar) > width:   # the tallest crop whose rounded width still fits
            max_h = int((width + 0.5 - 1e-7) / ar)
            max_h -= round(max_h * ar) > width
        max_h = min(max_h, height)
        ch = min(ch, max_h)
        if ch < max_h:
            ch += _randint(gen, max_h - ch + 1)
        cw = round(ch * ar)
        if cw * ch < min_area:
            ch += 1
            cw = round(ch * ar)
        if not (min_area <= cw * ch <= max_area and 0 < cw <= width and 0 < ch <= height
                and cw * ch >= INCEPTION_MIN_COVERED * area):
            continue
        top = _randint(gen, height - ch) if ch < height else 0
        left = _randint(gen, width - cw) if cw < width else 0
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

    pipeline = "loader"   # ``data.pipeline``'s name for it: how an evaluation image is resized
    note = ""             # said after ``describe()`` (why data.decode auto chose this path)

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
        self.mean, self.std = tuple(float(v) for v in raw.mean), tuple(float(v) for v in raw.std)
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
                      augment_twice: bool, shard: tuple[int, int] = (0, 1)) -> Iterator[Batch]:
        """As ``DeviceData.train_batches``; the order is drawn on the host (the workers need it there)."""
        b = _check_batching(batch_size, steps, shard)
        first = shard[0] * b
        n, cpu = steps * batch_size, torch.device("cpu")
        order = lambda pool, stream: epoch_order(torch.from_numpy(pool), n,
                                                 _generator(seed, epoch, stream, cpu)).numpy()
        sup, unsup = order(self.splits.labeled, "labeled"), order(self.splits.unlabeled, "unlabeled")
        base = stream_seed(seed, epoch, "augment")

        def batches() -> Iterator[list]:
            for s in range(steps):
                yield [(int(sup[j]), int(unsup[j]), (base + j * _GOLDEN) % (1 << 63), augment_twice)
                       for j in range(s * batch_size + first, s * batch_size + first + b)]
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

    def eval_batches(self, split: str, batch_size: int,
                     shard: tuple[int, int] = (0, 1)) -> Iterator[tuple[Tensor, Tensor]]:
        """(x (b, 3, S, S) float32 normalised, y (b,) int64) in index order; the last batch may be short."""
        _check_eval_split(split, self.sizes)
        check(batch_size >= 1, "batch_size", "be >= 1", batch_size)
        idx = self.splits.val if split == "val" else np.arange(self.sizes["test"])
        starts = eval_starts(len(idx), batch_size, shard)
        loader, sampler = self._loader("eval")
        sampler.make = lambda: ([(split, int(i)) for i in idx[s:s + batch_size]] for s in starts)
        sampler.count = len(starts)
        return ((self._to_device(x), y.to(self.device, non_blocking=True)) for x, y in loader)

    def describe(self) -> str:
        aug = f"inception crop {self.image_size}{' + flip' if self.flip else ''}" \
              f"{' + colour jitter' if self.colour_jitter else ''}"
        return (f"{self.name}: {_describe_sizes(self.sizes)}, 3x{self.image_size}x{self.image_size}, "
                f"loader pipeline ({self.workers} workers, PIL) to {self.device} ({aug}){self.note}")
