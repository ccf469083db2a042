"""Datasets, splits and batches for semi-supervised training.

``prepare_data(cfg, labeled_seed, device)`` is the entry point the trainer uses. It loads a
dataset from the ``DATASETS`` registry, carves the validation holdout and the labeled subset
(``make_splits``, stratified as in the reference ``small_image_data_source.py``) and returns a
``TrainData``:

* ``DeviceData`` (small images): the whole decoded uint8 dataset lives on the training device;
  a batch is one gather that does reflect-pad, random crop and flip at once, then a normalise.
* ``LoaderData`` (large images, ImageFolder/ImageNet layout): files are read lazily by a
  DataLoader; inception crop + flip (+ colour jitter) per sample, as in the reference ImageNet
  pipeline (``data.decode: pil``).
* ``DecodedData`` (large JPEGs, ``data.decode: device``): the same images and augmentation rules, decoded
  (nvJPEG) and augmented as batched tensor ops on the training device.
* ``HybridData`` (large JPEGs, ``data.decode: hybrid``, and ``auto`` on a GPU): each batch split by position
  between the two, ``data.cpu_fraction`` of it by PIL in the workers, the rest on the device.

Determinism: ``train_batches(epoch, seed, ...)`` is a pure function of the data and its
arguments. It derives its own generators from (seed, epoch, stream) and never reads the global
RNG, so a run resumed at an epoch boundary sees the same batches bit-for-bit.

Reference: "Milking CowMask for Semi-Supervised Image Classification", French, Oliver and
Salimans, arXiv:2003.12022, and its published code (``milking_cowmask/data_sources``).

Modules: ``sources`` (``RawDataset``, the ``DATASETS`` registry and its loaders), ``image_files``
(ImageFolder trees and zips, decode cache), ``splits`` (``make_splits`` and split hashes),
``batches`` (``Batch``, ``TrainData``, random streams, normalisation), ``device`` (``DeviceData``),
``loader`` (``LoaderData``), ``gpu_decode`` (decoding and augmentation as tensor ops), ``gpu_loader``
(``DecodedData``) and ``hybrid_loader`` (``HybridData``). Their public names are re-exported here. Anything may
import it; it imports only
``trainables.validation``, ``trainables.file_locks`` and ``trainables.child_process`` (its decoding workers).
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np
import torch

from trainables.data.batches import Batch, TrainData, data_record, epoch_order, normalise, stream_seed
from trainables.data.device import DeviceData, crop_flip_params, gather_crops, window_indices
from trainables.data.gpu_loader import DecodedData, first_is_jpeg
from trainables.data.hybrid_loader import HybridData, auto_cpu_fraction, host_rows
from trainables.data.image_files import FileImages, ScoredImages, scored_images
from trainables.data.loader import (EVAL_CROP, INCEPTION_RATIO, INCEPTION_SCALE, LOADER_IMAGE_SIZE, LoaderData,
                                    eval_view, inception_box, train_view)
from trainables.data.sources import (DATASETS, NORMALISATION, SMALL_IMAGE_MAX, TORCHVISION_FILES, TRAIN_SIZES,
                                     Loader, RawDataset, check_dataset, check_source, load_raw, register_dataset,
                                     train_size)
from trainables.data.splits import Splits, make_splits
from trainables.validation import ConfigError, check

if TYPE_CHECKING:
    from trainables.config import DataConfig

MAY_IMPORT = ("trainables.validation", "trainables.file_locks", "trainables.child_process")

__all__ = [
    "Batch", "DATASETS", "DecodedData", "DeviceData", "EVAL_CROP", "FileImages", "HybridData", "INCEPTION_RATIO",
    "INCEPTION_SCALE",
    "LOADER_IMAGE_SIZE", "Loader", "LoaderData", "NORMALISATION", "RawDataset", "SMALL_IMAGE_MAX", "Splits",
    "ScoredImages", "TORCHVISION_FILES", "TRAIN_SIZES", "TrainData", "check_dataset", "check_source",
    "auto_cpu_fraction", "crop_flip_params", "data_record", "epoch_order", "host_rows",
    "eval_view", "gather_crops", "inception_box", "load_raw", "make_splits", "normalise", "prepare_data",
    "register_dataset", "resolve_decode", "scored_images", "stream_seed", "train_size", "train_view",
    "warm_decode_cache",
    "window_indices",
]


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------

def warm_decode_cache(cfg: "DataConfig") -> threading.Thread | None:
    """Decode an image-folder dataset into its cache in a background thread, e.g. on a search driver while
    Ray starts its workers: they then read the cache (or wait for the decoding) instead of each decoding.
    A bad file (``ConfigError``: an image that cannot be decoded, mixed sizes) is kept as the thread's ``error``
    for the driver to report before trials start; other errors are left to the workers, which report them per
    trial. None when there is nothing to decode."""
    if cfg.dataset != "imagefolder" or cfg.pipeline == "loader":
        return None

    def decode() -> None:
        try:
            load_raw(cfg)
        except ConfigError as exc:
            thread.error = exc
        except Exception:   # noqa: BLE001 - the trials load the data again and say what is wrong
            pass

    thread = threading.Thread(target=decode, name="cowtune-decode-cache", daemon=True)
    thread.error = None
    thread.start()
    return thread


def prepare_data(cfg: "DataConfig", labeled_seed: int, device: torch.device,
                 compiled: bool | None = None) -> TrainData:
    """Load ``cfg.dataset``, split it and return the pipeline for ``device``.

    Args:
        cfg: the data config. labeled_seed: seed of the labeled subset (``TrainConfig.labeled_seed``).
        device: the training device; batches are returned there.
        compiled: augment on the device under torch.compile (``train.fast.compile``; None: on a GPU).
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
        return DeviceData(raw, splits, flip, cfg.pad, device, cfg.image_size, compiled=compiled)
    if isinstance(raw.train_images, np.ndarray):
        check(cfg.decode not in ("device", "hybrid"), "data.decode", f"be 'auto' or 'pil' for dataset "
              f"'{cfg.dataset}' (its images are in memory, not files to decode)", cfg.decode)
        size = cfg.image_size or raw.train_images.shape[1]   # in-memory small images: native size
        return LoaderData(raw, splits, flip, size, cfg.colour_jitter, cfg.workers, device)
    size = cfg.image_size or LOADER_IMAGE_SIZE
    decode, note = resolve_decode(cfg.decode, raw.train_images, device)
    if decode == "hybrid":
        data = HybridData(raw, splits, flip, size, cfg.colour_jitter, cfg.workers, device, cfg.cpu_fraction,
                          rule=cfg.decode)
    else:
        pipeline = DecodedData if decode == "device" else LoaderData
        data = pipeline(raw, splits, flip, size, cfg.colour_jitter, cfg.workers, device)
    data.note = note
    return data


def resolve_decode(decode: str, files: FileImages, device: torch.device) -> tuple[str, str]:
    """``data.decode`` resolved for these files on this device: ("pil", "device" or "hybrid", a note for the log
    line when "auto" chose PIL on a GPU). "auto": hybrid on cuda when the files are JPEGs (its share by
    ``auto_cpu_fraction``), else pil."""
    if decode != "auto":
        return decode, ""
    if device.type != "cuda":
        return "pil", ""
    if first_is_jpeg(files):
        return "hybrid", ""
    return "pil", (f"; data.decode auto: {files.names[0]} is not a JPEG, so PIL decodes on the host "
                   "(data.decode device or hybrid takes JPEGs on the GPU and other files on the host)")
