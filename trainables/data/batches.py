"""What both pipelines share: the ``Batch`` and ``TrainData`` contract, per-epoch random streams,
normalisation and the argument checks.

Determinism: ``train_batches(epoch, seed, ...)`` is a pure function of the data and its
arguments. It derives its own generators from (seed, epoch, stream) through ``stream_seed`` and
never reads the global RNG, so a run resumed at an epoch boundary sees the same batches bit-for-bit.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Protocol, Sequence

import torch
from torch import Tensor

from trainables.validation import check

if TYPE_CHECKING:
    from trainables.data.sources import RawDataset
    from trainables.data.splits import Splits


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
    class_names: list[str]              # in label order
    image_shape: tuple[int, int, int]   # (C, H, W) of training batches
    mean: tuple[float, ...]             # per-channel normalisation on the 0..1 scale
    std: tuple[float, ...]
    pipeline: str                       # "device" or "loader"
    sizes: dict[str, int]               # train, val, labeled, unlabeled, test (0 = none)
    split_hashes: dict[str, str]        # val, labeled, unlabeled -> 16 hex chars

    def default_steps_per_epoch(self, batch_size: int) -> int: ...
    def train_batches(self, epoch: int, seed: int, batch_size: int, steps: int,
                      augment_twice: bool, shard: tuple[int, int] = (0, 1)) -> Iterator[Batch]: ...
    # ``shard`` (rank, world): only batches k with k % world == rank, the others never read (data-parallel evaluation)
    def eval_batches(self, split: str, batch_size: int,
                     shard: tuple[int, int] = (0, 1)) -> Iterator[tuple[Tensor, Tensor]]: ...
    def describe(self) -> str: ...


def data_record(data: TrainData) -> dict[str, Any]:
    """What a checkpoint keeps of its training data, so that its model can score other images the way it was
    evaluated (``cowtune evaluate``): class names in label order, per-channel mean and std (0..1 scale), the
    input shape (C, H, W) and the pipeline ("device": native size or resized to it; "loader": centre crop).
    Lists, strings and numbers only: a checkpoint holding it loads with ``torch.load(weights_only=True)``."""
    return {"class_names": [str(c) for c in data.class_names], "mean": [float(v) for v in data.mean],
            "std": [float(v) for v in data.std], "image_shape": [int(v) for v in data.image_shape],
            "pipeline": str(data.pipeline)}


# ---------------------------------------------------------------------------------------------
# Randomness (one generator per named stream and epoch) and normalisation
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


def _norm_constants(mean: Sequence[float], std: Sequence[float], device: torch.device) -> tuple[Tensor, Tensor]:
    """scale, shift of shape (1, C, 1, 1) with x * scale + shift == (x / 255 - mean) / std."""
    m = torch.tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1)
    return 1.0 / (255.0 * s), -m / s


def normalise(x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """uint8 (B, C, H, W) -> float32 (B, C, H, W) normalised (see ``_norm_constants``)."""
    return x.float().mul_(scale).add_(shift)


# ---------------------------------------------------------------------------------------------
# Sizes and argument checks of both pipelines
# ---------------------------------------------------------------------------------------------

def _sizes(raw: RawDataset, splits: Splits) -> dict[str, int]:
    return {"train": len(raw.train_labels), "val": len(splits.val), "labeled": len(splits.labeled),
            "unlabeled": len(splits.unlabeled), "test": 0 if raw.test_labels is None else len(raw.test_labels)}


def _describe_sizes(sizes: dict[str, int]) -> str:
    return (f"train {sizes['train']} (val {sizes['val']}, labeled {sizes['labeled']}, "
            f"unlabeled {sizes['unlabeled']}), test {sizes['test']}")


def _check_batching(batch_size: int, steps: int, shard: tuple[int, int] = (0, 1)) -> int:
    """The images of each batch this shard gets: ``batch_size`` split evenly over ``shard = (rank, world)``."""
    check(batch_size >= 1, "batch_size", "be >= 1", batch_size)
    check(steps >= 1, "steps", "be >= 1", steps)
    rank, world = shard
    check(world >= 1 and batch_size % world == 0, "train.batch_size",
          f"be divisible by the {world} data-parallel workers that split it", batch_size)
    check(0 <= rank < world, "shard", f"be a rank in 0..{world - 1}", rank)
    return batch_size // world


def eval_starts(count: int, batch_size: int, shard: tuple[int, int]) -> range:
    """Where each of a shard's evaluation batches starts among ``count`` rows: batch k of the whole split for
    k % world == rank (``shard`` = (rank, world)); the last batch may be short."""
    rank, world = shard
    return range(rank * batch_size, count, world * batch_size)


def _check_eval_split(split: str, sizes: dict[str, int]) -> None:
    check(split in ("val", "test"), "data.eval_split", "be 'val' or 'test'", split)
    check(split != "val" or sizes["val"] > 0, "data.eval_split",
          "be 'test' when data.n_val is 0 (there is no holdout)", split)
    check(split != "test" or sizes["test"] > 0, "data.eval_split",
          "be 'val' for a dataset without a test split", split)
