"""``HybridData``: each batch of large JPEGs split between the host path and the device path (``data.decode: hybrid``).

Neither path alone feeds ResNet-50 on one H200 at 90% of its step rate (docs/imagenet.md section 5): the host path
(PIL in DataLoader workers, ``LoaderData``) is bound by the host's cores, and the device path (``DecodedData``) takes
GPU time from the step. A split is bound by neither: a fixed share of each batch's rows (``data.cpu_fraction``) is
decoded and augmented by PIL in the workers, the rest by ``decode_jpeg`` on the device, and the two parts are put
back in their rows on the device.

Which rows, and what each row holds, depend only on the config and the seed, never on timing:

* row k of a global batch (k = 0..batch_size-1, the same k every step) goes to the host when
  floor((k + 1) f + 1/2) > floor(k f + 1/2), f = ``cpu_fraction``: round(batch_size f) rows, spread evenly over the
  batch, so each data-parallel worker's slice gets its share (within one row) and is its part of the one-process
  batch;
* a host row is exactly ``LoaderData``'s row at that position (its per-sample generator), and a device row is exactly
  ``DecodedData``'s (the whole batch's draws, cut to the row): f = 1 is the host path's batch and f = 0 the device
  path's, bit for bit;
* labels come from the epoch's order, as in both paths.

Evaluation batches take the device path (``DecodedData.eval_batches``). On a CPU the "device" is the CPU
(libjpeg through ``decode_jpeg``), which is how the tests run it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch
from torch import Tensor

from trainables.data.batches import Batch, _check_batching, _generator, epoch_order, normalise, stream_seed
from trainables.data.gpu_loader import DecodedData, _prefetched
from trainables.data.loader import _GOLDEN, LoaderData

if TYPE_CHECKING:
    from trainables.data.sources import RawDataset
    from trainables.data.splits import Splits

# data.decode auto's rule (docs/imagenet.md section 5), measured on one H200 with 16 host cores: at 128 images a GPU
# the split at 0.8 reached 0.70 of ResNet-50's ceiling and 0.89 of ResNet-152's (0.7: 0.60 and 0.92; pil alone 0.61
# and 0.97; device alone 0.61 and 0.83)
AUTO_WORKERS = 16             # the workers the shares below were worked out for; scaled linearly by data.workers
AUTO_LARGE_BATCH = 64         # per-GPU labeled batch at and above which the large-batch share applies
AUTO_SHARE_LARGE = 0.8        # the best measured for ResNet-50 at 128, the paper's model at its per-GPU batch
AUTO_SHARE_SMALL = 1.0        # pil measured 0.98 of ResNet-50's ceiling at 16 a GPU; the device path 0.65


def auto_cpu_fraction(per_gpu_batch: int, workers: int) -> float:
    """``data.decode auto``'s share of each batch for PIL: ``AUTO_SHARE_*`` for 16 workers, scaled by
    ``workers / 16`` (the host side's rate is about proportional to its workers) and capped at 1; 0 without workers
    (the host rows would be decoded by the training process itself)."""
    share = AUTO_SHARE_LARGE if per_gpu_batch >= AUTO_LARGE_BATCH else AUTO_SHARE_SMALL
    return min(1.0, share * workers / AUTO_WORKERS)


def host_rows(first: int, count: int, fraction: float) -> np.ndarray:
    """(count,) bool: which of the global batch's rows first..first+count-1 PIL decodes on the host (module
    docstring: round(batch f) rows of a batch, evenly spread, a pattern fixed by position)."""
    k = np.arange(first, first + count, dtype=np.float64)
    return np.floor((k + 1) * fraction + 0.5) > np.floor(k * fraction + 0.5)


class HybridData(DecodedData):
    """``DecodedData`` whose training batches leave ``cpu_fraction`` of their rows to PIL in ``workers`` DataLoader
    workers (``LoaderData``'s); None: ``auto_cpu_fraction`` of each call's per-worker batch."""

    def __init__(self, raw: RawDataset, splits: Splits, flip: bool, image_size: int, colour_jitter: bool,
                 workers: int, device: torch.device, cpu_fraction: float | None = None, rule: str = "hybrid"):
        super().__init__(raw, splits, flip, image_size, colour_jitter, workers, device)
        self.workers = workers            # LoaderData's DataLoader, for the host rows (DecodedData keeps it at 0)
        self.cpu_fraction = cpu_fraction  # None: the rule, per batch size
        self.rule = rule                  # what chose it, for describe(): "hybrid" or "auto"
        self.used: tuple[float, int, int] | None = None   # (fraction, host rows, rows) of the last train_batches

    def fraction_for(self, per_gpu_batch: int) -> float:
        if self.cpu_fraction is not None:
            return self.cpu_fraction
        return auto_cpu_fraction(per_gpu_batch, self.workers)

    def train_batches(self, epoch: int, seed: int, batch_size: int, steps: int,
                      augment_twice: bool, shard: tuple[int, int] = (0, 1)) -> Iterator[Batch]:
        b = _check_batching(batch_size, steps, shard)
        first = shard[0] * b
        fraction = self.fraction_for(b)
        host = host_rows(first, b, fraction)
        self.used = (fraction, int(host.sum()), b)
        if not host.any():      # every row on the device: the device path's batches
            return DecodedData.train_batches(self, epoch, seed, batch_size, steps, augment_twice, shard)
        if host.all():          # every row on the host: the host path's batches
            return LoaderData.train_batches(self, epoch, seed, batch_size, steps, augment_twice, shard)

        n, cpu = steps * batch_size, torch.device("cpu")
        order = lambda pool, stream: epoch_order(torch.from_numpy(pool), n,
                                                 _generator(seed, epoch, stream, cpu)).numpy()
        sup, unsup = order(self.splits.labeled, "labeled"), order(self.splits.unlabeled, "unlabeled")
        views = 3 if augment_twice else 2
        at_host, at_device = np.flatnonzero(host), np.flatnonzero(~host)     # rows of this shard's slice
        device_cols = torch.from_numpy(first + at_device)                     # columns of the global batch

        base = stream_seed(seed, epoch, "augment")    # LoaderData's per-sample seeds, at the same positions

        def host_items() -> Iterator[list]:
            for s in range(steps):
                yield [(int(sup[j]), int(unsup[j]), (base + j * _GOLDEN) % (1 << 63), augment_twice)
                       for j in (s * batch_size + first + at_host).tolist()]
        loader, sampler = self._loader("train")
        sampler.make, sampler.count = host_items, steps

        def device_part(s: int) -> tuple[Tensor, ...]:
            j = s * batch_size + first + at_device
            return tuple(self._train_views(seed, epoch, s, batch_size, views, device_cols, sup[j], unsup[j]))

        parts = _prefetched(device_part, steps, self.device)   # built ahead, on its own CUDA stream on a GPU
        return self._merged(loader, parts, sup, first, b, batch_size, at_host, at_device, augment_twice)

    def _merged(self, loader, parts: Iterator, sup: np.ndarray, first: int, b: int, batch_size: int,
                at_host: np.ndarray, at_device: np.ndarray, augment_twice: bool) -> Iterator[Batch]:
        """Each step's host part (from the workers, in order) and device part put back in their rows."""
        to_host = torch.from_numpy(at_host).to(self.device)
        to_device = torch.from_numpy(at_device).to(self.device)

        def merge(host: Tensor, dev: Tensor) -> Tensor:
            x = torch.empty((b, *dev.shape[1:]), dtype=torch.uint8, device=self.device)   # (b, 3, S, S)
            x.index_copy_(0, to_host, host.to(self.device, non_blocking=True))
            x.index_copy_(0, to_device, dev)
            return normalise(x, self._scale, self._shift)
        try:
            for s, ((x_sup, _, x_u0, x_u1), dev) in enumerate(zip(loader, parts)):
                x = [merge(h, d) for h, d in zip((x_sup, x_u0, x_u1), dev)]
                rows = slice(s * batch_size + first, s * batch_size + first + b)
                y = torch.from_numpy(self._labels["train"][sup[rows]]).to(self.device, non_blocking=True)
                yield Batch(x[0], y, x[1], x[2] if augment_twice else x[1])
        finally:
            parts.close()

    def describe(self) -> str:
        if self.cpu_fraction is not None:
            share = f"{self.cpu_fraction:g} of each batch"
        elif self.used is not None:
            share = f"{self.used[0]:g} of each batch (data.decode {self.rule}'s rule at {self.used[2]} a worker)"
        else:
            share = (f"data.decode {self.rule}'s rule: {auto_cpu_fraction(AUTO_LARGE_BATCH, self.workers):g} of "
                     f"batches of {AUTO_LARGE_BATCH} or more a worker, "
                     f"{auto_cpu_fraction(1, self.workers):g} of smaller ones")
        how = "nvJPEG" if self.device.type == "cuda" else "libjpeg"
        return (super().describe().replace(f"decoded on {self.device} ({how}, ",
                                           f"hybrid: PIL in {self.workers} workers for {share}, the rest decoded on "
                                           f"{self.device} ({how}, "))
