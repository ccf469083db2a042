"""``DeviceData``: small images decoded once and kept on the training device as uint8 (N, C, H, W).

A training batch is one gather that does reflect-pad, random crop and flip at once, then a
normalise; the helpers are vectorised over the batch and do no host syncs.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from trainables.data.batches import (Batch, _check_batching, _check_eval_split, _describe_sizes, _generator,
                                     eval_starts, _norm_constants, _sizes, epoch_order, normalise)
from trainables.validation import check

if TYPE_CHECKING:
    from trainables.data.sources import RawDataset
    from trainables.data.splits import Splits


# ---------------------------------------------------------------------------------------------
# Augmentation helpers (device side, vectorised over the batch)
# ---------------------------------------------------------------------------------------------

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


def augment(images: Tensor, idx: Tensor, oy: Tensor, ox: Tensor, flips: Tensor, pad: int, scale: Tensor,
            shift: Tensor) -> Tensor:
    """(B,) indices and per-sample crop offsets and flips -> (B, C, H, W) float32 normalised views of ``images``
    (N, C, H, W) uint8, reflect-padded by ``pad``."""
    _, _, h, w = images.shape
    rows = window_indices(oy, h, pad)                                               # (B, H)
    cols = window_indices(ox, w, pad, flips)                                        # (B, W)
    return normalise(gather_crops(images, idx, rows, cols), scale, shift)


@functools.cache
def compiled_augment():
    """``augment`` under torch.compile: on a GPU its index arithmetic, gather and normalisation are two or three
    kernels, where eagerly they are some 20 per view (WRN-28-2 CowMix on an H100: 0.5 ms for 8 steps' views,
    the GPU doing nothing else meanwhile)."""
    return torch.compile(augment, dynamic=False)


# ---------------------------------------------------------------------------------------------
# DeviceData: the whole dataset on the training device
# ---------------------------------------------------------------------------------------------

CHUNK_BYTES = 128 * 2**20   # at most this much of augmented batches at once (8 CIFAR steps of 256 + 256: 50 MB)


class DeviceData:
    """Small images, decoded once and kept on ``device`` as uint8 (N, C, H, W).

    A training view is reflect pad ``pad`` + random crop back to H x W + optional flip, done as
    one gather for ``chunk_steps`` steps' batches at once (fewer where they would pass ``CHUNK_BYTES``),
    then normalised, under torch.compile on a GPU (``compiled``). No host syncs inside ``train_batches``.
    (The chunk: the 64 small kernels of the gathers and their index arithmetic run once per chunk, not once
    per step, where they kept the GPU waiting between steps for the host to launch them: 0.29 ms of a 5.8 ms
    WRN-28-2 CowMix step on an H200. The batches are the same, bit for bit. Compiled, they are a few
    kernels: +1.2% in the step on an H100.)
    """

    pipeline = "device"   # ``data.pipeline``'s name for it: how an evaluation image is resized

    def __init__(self, raw: RawDataset, splits: Splits, flip: bool, pad: int, device: torch.device,
                 image_size: int | None = None, chunk_steps: int = 8, compiled: bool | None = None):
        check(chunk_steps >= 1, "chunk_steps", "be >= 1", chunk_steps)
        self.name, self.device, self.flip, self.pad, self.splits = raw.name, device, flip, pad, splits
        self.chunk_steps = chunk_steps
        self.compiled = device.type == "cuda" if compiled is None else compiled   # augment under torch.compile
        self.images = _to_device_nchw(raw.train_images, image_size, device)            # (N, C, H, W) uint8
        self.test_images = None if raw.test_images is None else _to_device_nchw(raw.test_images, image_size, device)
        self.labels = torch.from_numpy(raw.train_labels).to(device)
        self.test_labels = None if raw.test_labels is None else torch.from_numpy(raw.test_labels).to(device)
        c, h, w = self.images.shape[1:]
        check(pad < min(h, w), "data.pad", f"be smaller than the image side ({min(h, w)})", pad)
        self._index = {k: torch.from_numpy(getattr(splits, k)).to(device) for k in ("val", "labeled", "unlabeled")}
        self._scale, self._shift = _norm_constants(raw.mean, raw.std, device)
        self.mean, self.std = tuple(float(v) for v in raw.mean), tuple(float(v) for v in raw.std)
        self.num_classes, self.class_names = len(raw.class_names), list(raw.class_names)
        self.image_shape = (int(c), int(h), int(w))
        self.sizes = _sizes(raw, splits)
        self.split_hashes = dict(splits.hashes)

    def default_steps_per_epoch(self, batch_size: int) -> int:
        return max(1, self.sizes["unlabeled"] // batch_size)

    def train_batches(self, epoch: int, seed: int, batch_size: int, steps: int,
                      augment_twice: bool, shard: tuple[int, int] = (0, 1)) -> Iterator[Batch]:
        """``steps`` batches of ``batch_size`` labeled and unlabeled images for this (epoch, seed).

        ``shard = (rank, world)``: data-parallel worker ``rank`` of ``world`` gets its slice of each batch, the
        images and augmentation one process would draw (so ``world`` workers see one process's batches, split)."""
        b = _check_batching(batch_size, steps, shard)
        n, dev = steps * batch_size, self.device
        sup = epoch_order(self._index["labeled"], n, _generator(seed, epoch, "labeled", dev))
        unsup = epoch_order(self._index["unlabeled"], n, _generator(seed, epoch, "unlabeled", dev))
        views = 3 if augment_twice else 2
        params = crop_flip_params((views, steps, batch_size), self.pad, self.flip,
                                  _generator(seed, epoch, "augment", dev))        # 3 x (views, steps, B)
        cols = slice(shard[0] * b, (shard[0] + 1) * b)
        sup, unsup = sup.view(steps, batch_size)[:, cols], unsup.view(steps, batch_size)[:, cols]
        params = tuple(p[..., cols] for p in params)
        return self._iterate(sup, self.labels[sup], unsup, params, augment_twice)

    def _iterate(self, sup: Tensor, y: Tensor, unsup: Tensor, params: tuple[Tensor, Tensor, Tensor],
                 augment_twice: bool) -> Iterator[Batch]:
        steps, b = sup.shape
        views = 3 if augment_twice else 2
        step_bytes = views * b * self.images[0].numel() * 4   # float32 views
        chunk = max(1, min(self.chunk_steps, CHUNK_BYTES // step_bytes))
        for c0 in range(0, steps, chunk):   # the views of `chunk` steps at once
            c1 = min(c0 + chunk, steps)
            # A short last chunk is augmented as a whole one ending with it, its first views again (the same
            # ones: each step's parameters are drawn beforehand): one shape for the compiled augmentation,
            # which would otherwise compile again at the end of the first epoch.
            a0 = max(0, c1 - chunk)
            # One gather for all views, laid out (step, view, B, C, H, W): a step's views lie back to back, so a
            # captured step copies them into its inputs at once (trainables.fast.step_graph)
            idx = torch.stack([sup[a0:c1], unsup[a0:c1]] + ([unsup[a0:c1]] if augment_twice else []), dim=1)
            flat = (t.flatten() for t in (idx, *(p[:views, a0:c1].transpose(0, 1) for p in params)))
            x = self._augment(*flat).unflatten(0, (c1 - a0, views, b))
            for s in range(c0 - a0, c1 - a0):
                u0 = x[s, 1]
                yield Batch(x[s, 0], y[a0 + s], u0, x[s, 2] if augment_twice else u0)

    def _augment(self, idx: Tensor, oy: Tensor, ox: Tensor, flips: Tensor) -> Tensor:
        """(B,) indices and per-sample params -> (B, C, H, W) float32 normalised views."""
        run = compiled_augment() if self.compiled else augment
        return run(self.images, idx, oy, ox, flips, self.pad, self._scale, self._shift)

    def eval_batches(self, split: str, batch_size: int,
                     shard: tuple[int, int] = (0, 1)) -> Iterator[tuple[Tensor, Tensor]]:
        """(x (b, C, H, W) float32 normalised, y (b,) int64) in index order; the last batch may be short."""
        images, labels, idx = self._eval_source(split)
        check(batch_size >= 1, "batch_size", "be >= 1", batch_size)
        return ((normalise(images[idx[i:i + batch_size]], self._scale, self._shift), labels[idx[i:i + batch_size]])
                for i in eval_starts(len(idx), batch_size, shard))

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
