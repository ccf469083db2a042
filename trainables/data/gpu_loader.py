"""``DecodedData``: large JPEG images decoded and augmented on the training device (``data.decode: device``).

Host threads read the files' bytes; ``trainables.data.gpu_decode`` decodes them on the device (nvJPEG on a GPU)
and augments them there as batched tensor ops. A producer thread builds the next batches (``PREFETCH``) while the
step runs, on its own CUDA stream, so the GPU decodes and trains at once and the host does little but read.

The same images in the same order as ``LoaderData`` (the host path, PIL in DataLoader workers); the crops, flips
and jitter come from one CPU generator per step, drawn for the whole batch, so a data-parallel worker's slice is
its part of the one-process batch (``shard``), and nothing depends on the device or the number of threads.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np
import torch
from torch import Tensor

from trainables.data import gpu_decode as G
from trainables.data.batches import (Batch, _check_batching, _check_eval_split, _describe_sizes, _generator,
                                     eval_starts, epoch_order, normalise, stream_seed)
from trainables.data.image_files import FileImages
from trainables.data.loader import LoaderData
from trainables.validation import check

if TYPE_CHECKING:
    from trainables.data.sources import RawDataset
    from trainables.data.splits import Splits

PREFETCH = 2          # batches built ahead of the step


def first_is_jpeg(images: FileImages) -> bool:
    """Whether the first training file is a JPEG (by its bytes, not its name): ``data.decode: auto``'s test."""
    return G.jpeg_header(G.read_bytes(images, 0)) is not None


class DecodedData(LoaderData):
    """``LoaderData``'s sizes, splits, order and normalisation; decoding and augmentation on the device."""

    def __init__(self, raw: RawDataset, splits: Splits, flip: bool, image_size: int, colour_jitter: bool,
                 workers: int, device: torch.device):
        super().__init__(raw, splits, flip, image_size, colour_jitter, 0, device)
        self.threads = max(2, workers)   # host threads reading files
        self._files = {"val": raw.train_images, "train": raw.train_images, "test": raw.test_images}
        self._labels = {"val": raw.train_labels, "train": raw.train_labels, "test": raw.test_labels}
        self._decode = G.Decoder(device, raw.name)
        self._pool: ThreadPoolExecutor | None = None

    def _read(self, split: str, idx: np.ndarray) -> list[Tensor]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="cowtune-read")
        files = self._files[split]
        return self._decode(list(self._pool.map(lambda i: G.read_bytes(files, int(i)), idx)))

    def _views(self, images: list[Tensor], u: Tensor, flips: Tensor, jitter: tuple[Tensor, Tensor]) -> Tensor:
        """Inception crops of ``images`` -> uint8 (n, 3, S, S) on the device, not yet normalised."""
        x = G.crop_resize(images, G.inception_boxes(G.image_sizes(images), u), self.image_size)
        if self.flip:
            x = G.flip_(x, flips)
        if self.colour_jitter:
            x = G.colour_jitter(x, *jitter)
        return G.to_uint8(x)

    def _train_views(self, seed: int, epoch: int, s: int, batch_size: int, views: int, cols: slice | Tensor,
                     sup_rows: np.ndarray, unsup_rows: np.ndarray) -> list[Tensor]:
        """Step ``s``'s views (labeled, unlabeled, [unlabeled again]) of the batch's columns ``cols``, uint8
        (len(cols), 3, S, S) each. The crops, flips and jitter are drawn for the whole batch of ``batch_size`` from
        one CPU generator, then cut to ``cols``: a column's images are the same whichever columns are asked for
        (a data-parallel worker's slice, or the rows ``HybridData`` leaves to the device)."""
        gen = torch.Generator().manual_seed(stream_seed(seed, epoch, f"augment-step{s}"))
        u = G.crop_uniforms(views * batch_size, gen).view(views, batch_size, -1, 4)[:, cols]
        flips = (torch.rand((views, batch_size), generator=gen) < 0.5)[:, cols]
        factors, perm = G.jitter_params(views * batch_size, gen)
        factors = factors.view(views, batch_size, 4)[:, cols]
        perm = perm.view(views, batch_size, 4)[:, cols]
        sup_images, unsup_images = self._read("train", sup_rows), self._read("train", unsup_rows)
        return [self._views(imgs, u[v], flips[v], (factors[v], perm[v]))
                for v, imgs in enumerate((sup_images, unsup_images, unsup_images)[:views])]

    def train_batches(self, epoch: int, seed: int, batch_size: int, steps: int,
                      augment_twice: bool, shard: tuple[int, int] = (0, 1)) -> Iterator[Batch]:
        b = _check_batching(batch_size, steps, shard)
        first, n, cpu = shard[0] * b, steps * batch_size, torch.device("cpu")
        order = lambda pool, stream: epoch_order(torch.from_numpy(pool), n,
                                                 _generator(seed, epoch, stream, cpu)).numpy()
        sup, unsup = order(self.splits.labeled, "labeled"), order(self.splits.unlabeled, "unlabeled")
        views = 3 if augment_twice else 2

        def make(s: int) -> Batch:
            # the whole batch's draws, then this shard's rows: the same images whatever the number of workers
            rows = slice(s * batch_size + first, s * batch_size + first + b)
            x = [normalise(v, self._scale, self._shift) for v in
                 self._train_views(seed, epoch, s, batch_size, views, slice(first, first + b), sup[rows], unsup[rows])]
            y = torch.from_numpy(self._labels["train"][sup[rows]]).to(self.device, non_blocking=True)
            return Batch(x[0], y, x[1], x[2] if augment_twice else x[1])
        return _prefetched(make, steps, self.device)

    def eval_batches(self, split: str, batch_size: int,
                     shard: tuple[int, int] = (0, 1)) -> Iterator[tuple[Tensor, Tensor]]:
        _check_eval_split(split, self.sizes)
        check(batch_size >= 1, "batch_size", "be >= 1", batch_size)
        idx = self.splits.val if split == "val" else np.arange(self.sizes["test"])
        chunks = [idx[s:s + batch_size] for s in eval_starts(len(idx), batch_size, shard)]

        def make(k: int) -> tuple[Tensor, Tensor]:
            images = self._read(split, chunks[k])
            x = G.crop_resize(images, G.centre_boxes(G.image_sizes(images)), self.image_size)
            y = torch.from_numpy(self._labels[split][chunks[k]]).to(self.device, non_blocking=True)
            return normalise(G.to_uint8(x), self._scale, self._shift), y
        return _prefetched(make, len(chunks), self.device)

    def describe(self) -> str:
        aug = f"inception crop {self.image_size}{' + flip' if self.flip else ''}" \
              f"{' + colour jitter' if self.colour_jitter else ''}"
        how = "nvJPEG" if self.device.type == "cuda" else "libjpeg"
        return (f"{self.name}: {_describe_sizes(self.sizes)}, 3x{self.image_size}x{self.image_size}, "
                f"decoded on {self.device} ({how}, {self.threads} reading threads) ({aug}){self.note}")


def _prefetched(make: Callable[[int], object], count: int, device: torch.device) -> Iterator:
    """``make(0), ..., make(count - 1)``, built ``PREFETCH`` ahead by a thread (on its own CUDA stream on a GPU);
    an error there is raised here; closing the iterator early stops the thread."""
    ready: queue.Queue = queue.Queue(maxsize=PREFETCH)
    stop = threading.Event()
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def produce() -> None:
        try:
            for k in range(count):
                if stream is not None:
                    with torch.cuda.stream(stream):
                        item = make(k)
                    event = torch.cuda.Event()
                    event.record(stream)
                else:
                    item, event = make(k), None
                while not stop.is_set():
                    try:
                        ready.put((item, event, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as exc:   # noqa: BLE001 - raised in the consumer, where the trainer handles it
            ready.put((None, None, exc))

    thread = threading.Thread(target=produce, name="cowtune-decode", daemon=True)
    thread.start()
    try:
        for _ in range(count):
            item, event, error = ready.get()
            if error is not None:
                raise error
            if event is not None:
                current = torch.cuda.current_stream(device)
                current.wait_event(event)
                for t in (item.__dict__.values() if isinstance(item, Batch) else item):
                    t.record_stream(current)   # made on the producer's stream, used (and freed) on this one
            yield item
    finally:
        stop.set()
