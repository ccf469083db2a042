"""``cowtune evaluate``: score a trained run's teacher and student on a folder or .zip of labelled images.

The images go through the run's own evaluation pipeline (``DeviceData`` or ``LoaderData``: the same resize or
centre crop and the same normalisation as its validation and test batches), are labelled in the run's class
order, and both models are scored by ``trainables.step.evaluate`` under the run's precision. The checkpoint
records class names, normalisation and input shape (``trainables.data.data_record``); for one written before
it did, they are the standard constants of a torchvision dataset, or recomputed from the run's training images.

Every check that can fail (checkpoint, data path, class folders, image size) runs before the models are built;
each failure is one ``ConfigError`` naming the option at fault.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from trainables.config import TrainConfig
from trainables.data import (NORMALISATION, DeviceData, LoaderData, RawDataset, ScoredImages, Splits, data_record,
                             prepare_data, scored_images)
from trainables.data.image_files import rescale_wide, unreadable
from trainables.data.image_decode import UNREADABLE, decode_images
from trainables.fast.switch import fast_path
from trainables.models import create_model
from trainables.step import evaluate
from trainables.trainer import CHECKPOINT
from trainables.validation import ConfigError, check

CHECKPOINT_KEYS = ("config", "epoch", "student", "teacher")
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CIFAR100_CLASSES = (
    "apple", "aquarium_fish", "baby", "bear", "beaver", "bed", "bee", "beetle", "bicycle", "bottle", "bowl", "boy",
    "bridge", "bus", "butterfly", "camel", "can", "castle", "caterpillar", "cattle", "chair", "chimpanzee", "clock",
    "cloud", "cockroach", "couch", "crab", "crocodile", "cup", "dinosaur", "dolphin", "elephant", "flatfish",
    "forest", "fox", "girl", "hamster", "house", "kangaroo", "keyboard", "lamp", "lawn_mower", "leopard", "lion",
    "lizard", "lobster", "man", "maple_tree", "motorcycle", "mountain", "mouse", "mushroom", "oak_tree", "orange",
    "orchid", "otter", "palm_tree", "pear", "pickup_truck", "pine_tree", "plain", "plate", "poppy", "porcupine",
    "possum", "rabbit", "raccoon", "ray", "road", "rocket", "rose", "sea", "seal", "shark", "shrew", "skunk",
    "skyscraper", "snail", "snake", "spider", "squirrel", "streetcar", "sunflower", "sweet_pepper", "table", "tank",
    "telephone", "television", "tiger", "tractor", "train", "trout", "tulip", "turtle", "wardrobe", "whale",
    "willow_tree", "wolf", "woman", "worm")
# Label order of the torchvision datasets as our loaders read them (trainables.data.sources), for checkpoints
# that do not record it; all three are 32x32 images.
STANDARD_CLASSES = {"cifar10": CIFAR10_CLASSES, "cifar100": CIFAR100_CLASSES,
                    "svhn": tuple(str(i) for i in range(10))}


def load_checkpoint(path: str) -> tuple[Path, dict[str, Any]]:
    """The checkpoint at ``path`` (a ``checkpoint.pt`` or the run folder holding one), loaded on the CPU with
    ``weights_only=True``: tensors and plain data, no code run from the file.

    Raises:
        ConfigError naming --checkpoint: not found, a folder without one, not a PyTorch file, objects beyond
        tensors and plain data, or not written by ``cowtune train``.
    """
    file = Path(path).expanduser()
    rule = f"--checkpoint must name a {CHECKPOINT} or the run folder holding it, got {path!r}"
    if not file.exists():
        raise ConfigError(f"{rule} (not found)")
    if file.is_dir():
        if not (file / CHECKPOINT).is_file():
            raise ConfigError(f"{rule} (a folder without {CHECKPOINT})")
        file = file / CHECKPOINT
    try:
        ckpt = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:   # noqa: BLE001 - a non-checkpoint raises KeyError, EOFError, RuntimeError...
        refused = re.search(r"WeightsUnpickler error: ([^\n]*?)\.? Please", str(exc))
        detail = (f"it holds objects that torch.load(weights_only=True) refuses: {refused.group(1)}" if refused
                  else f"not a PyTorch file: {type(exc).__name__} {str(exc).splitlines()[0][:120] if str(exc) else ''}")
        raise ConfigError(f"--checkpoint must be a checkpoint written by `cowtune train`, got {str(file)!r} "
                          f"({detail.strip()})") from None
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise ConfigError(f"--checkpoint must be a checkpoint written by `cowtune train`, got {str(file)!r} "
                          f"(a PyTorch file without {', '.join(missing)})")
    return file, ckpt


def legacy_record(cfg: TrainConfig, train_data: str | None) -> tuple[dict[str, Any], str]:
    """``data_record`` of a run whose checkpoint predates it, and where it came from.

    torchvision datasets: their standard class order and ``NORMALISATION``; others: the training data loaded as
    the run loaded it (``train_data`` replaces its ``data.root``; statistics come from the decode cache when there).

    Raises:
        ConfigError when an ImageFolder run's training images are not where ``data.root`` (or ``train_data``) says.
    """
    dataset = cfg.data.dataset
    if dataset in STANDARD_CLASSES:
        mean, std = NORMALISATION[dataset]
        side = cfg.data.image_size or 32
        return ({"class_names": list(STANDARD_CLASSES[dataset]), "mean": list(mean), "std": list(std),
                 "image_shape": [3, side, side], "pipeline": "loader" if cfg.data.pipeline == "loader" else "device"},
                f"the standard {dataset} class order and normalisation")
    data_cfg = cfg.data if train_data is None else dataclasses.replace(cfg.data, root=train_data)
    if dataset == "imagefolder" and not os.path.exists(os.path.expanduser(data_cfg.root)):
        raise ConfigError(
            f"--checkpoint predates recorded class names and normalisation, and the run's training images are not at "
            f"{'--train-data' if train_data else 'data.root'} {data_cfg.root!r} to recompute them from: pass "
            "--train-data PATH (the training tree or .zip), or run from the folder the run was trained in")
    data = prepare_data(data_cfg, cfg.labeled_seed, torch.device("cpu"), compiled=False)
    return data_record(data), f"recomputed from the training images at {data_cfg.root}"


def find_images(path: str) -> ScoredImages:
    """The images to score in the folder or .zip ``path`` (see ``trainables.data.scored_images``)."""
    root = os.path.abspath(os.path.expanduser(path))
    rule = f"--data must be a folder or .zip of class folders (or of train/ and test/), got {path!r}"
    if not os.path.exists(root):
        raise ConfigError(f"{rule} (not found)")
    if not (os.path.isdir(root) or zipfile.is_zipfile(root)):
        raise ConfigError(f"{rule} (neither a folder nor a .zip)")
    return scored_images(root, path, "--data")


def labels_for(images: ScoredImages, class_names: list[str]) -> np.ndarray:
    """(N,) int64 labels of ``images``: each class folder's index in the run's ``class_names``.

    Raises:
        ConfigError naming every class folder that is not one of the model's classes.
    """
    index = {c: i for i, c in enumerate(class_names)}
    unknown = sorted(set(images.classes) - set(index))
    if unknown:
        named = []
        for c in unknown:
            close = difflib.get_close_matches(c, class_names, n=1)
            named.append(f"{c!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        shown = ", ".join(class_names[:20]) + (f", ... ({len(class_names)} in all)" if len(class_names) > 20 else "")
        raise ConfigError(f"--data must hold class folders named as the model's classes ({shown}), "
                          f"got {', '.join(named)}")
    return np.array([index[c] for c in images.classes], dtype=np.int64)


def eval_pipeline(images: ScoredImages, labels: np.ndarray, record: dict[str, Any], cfg: TrainConfig,
                  device: torch.device) -> DeviceData | LoaderData:
    """The run's own pipeline class over ``images`` as its test split: ``eval_batches("test", b)`` gives
    (x (b, C, H, W) float32 normalised, y (b,)) as the run's evaluation did. (The class wants a training split
    too: the first image stands in for it.) Device pipeline: the images are decoded here, once.

    Raises:
        ConfigError naming --data: for the device pipeline, images not of the training size (or, when the run
        resized its images to ``data.image_size``, not all of one size).
    """
    one = np.zeros(1, dtype=np.int64)
    splits = Splits(val=one[:0], labeled=one, unlabeled=one, hashes={})
    mean, std, names = tuple(record["mean"]), tuple(record["std"]), list(record["class_names"])
    if record["pipeline"] == "loader":
        raw = RawDataset("evaluate", images.files, labels, images.files, labels, names, mean, std, False, "")
        return LoaderData(raw, splits, False, int(record["image_shape"][-1]), False, cfg.data.workers, device)
    array = decode_scored(images, tuple(record["image_shape"][1:]), resized=cfg.data.image_size is not None)
    raw = RawDataset("evaluate", array[:1], labels[:1], array, labels, names, mean, std, False, "")
    return DeviceData(raw, splits, False, 0, device, cfg.data.image_size, compiled=False)


def decode_scored(images: ScoredImages, trained_hw: tuple[int, int], resized: bool) -> np.ndarray:
    """uint8 (N, H, W, 3) of ``images``, decoded by ``trainables.data.image_decode`` (worker processes when many).
    Each must be ``trained_hw`` (H, W), or when the run ``resized`` its images, of the first one's size."""
    files = images.files
    try:
        w, h = files.open(0).size   # the header only
    except UNREADABLE as exc:
        raise unreadable(files.names[0], f"{type(exc).__name__}: {str(exc)[:200]}", files.root, "--data") from None
    want = (w, h) if resized else (trained_hw[1], trained_hw[0])
    rule = (f"--data must hold images of one size (the run resized its images to {trained_hw[1]}x{trained_hw[0]}; "
            f"the first here is {w}x{h})") if resized else \
        f"--data must hold images of the size the model was trained on ({want[0]}x{want[1]})"
    if (w, h) != want:
        raise ConfigError(f"{rule}, got {files.names[0]} of {w}x{h}")
    array, bad = decode_images(files.root, files.names, want)
    if bad is not None and isinstance(bad[1], str):   # a truncated or corrupt file
        raise unreadable(files.names[bad[0]], bad[1], files.root, "--data")
    if bad is not None:
        i, (bw, bh) = bad
        raise ConfigError(f"{rule}, got {files.names[i]} of {bw}x{bh}")
    rescale_wide(files, array, np.arange(len(array)), files.root, "--data")   # 16-bit greyscale, clipped above
    return array


def trained_on(cfg: TrainConfig, data: str, images: ScoredImages) -> str | None:
    """A line saying that the scored images are the run's training images, or None: ``data`` is the file or folder
    of the run's ``data.root`` (a relative one read from here) and what is scored is not its test/ or val/ split."""
    if cfg.data.dataset != "imagefolder" or images.folder.rsplit("/", 1)[-1] in ("test", "val"):
        return None
    try:
        same = os.path.samefile(os.path.expanduser(data), os.path.expanduser(cfg.data.root))
    except OSError:   # its data.root is gone, or was relative to another folder
        return None
    return (f"note: {data} is the run's own training data (its data.root), {images.folder or 'every class folder'} "
            "scored: it trained on these images, so this is no test error") if same else None


def _device(setting: str) -> torch.device:
    check(setting in ("auto", "cpu", "cuda"), "--device", "be auto, cpu or cuda", setting)
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device must name an available device, got 'cuda' (no CUDA here)")
    return torch.device(setting)


def evaluate_checkpoint(checkpoint: str, data: str, batch_size: int | None = None, device: str = "auto",
                        train_data: str | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Score the teacher and the student of ``checkpoint`` on the images of ``data``; returns (and logs) the result.

    Args:
        checkpoint: a ``checkpoint.pt`` or its run folder. data: a folder or .zip of class folders, or of split
            folders (then ``test/`` is scored). batch_size: default ``train.eval_batch_size``.
        device: "auto", "cpu" or "cuda". train_data: the training images, for a checkpoint without
            ``data_record`` whose ``data.root`` is gone (ImageFolder runs).
    Returns:
        {"checkpoint", "epoch", "step", "model", "method", "dataset", "data", "scored", "images", "classes",
        "class_names", "normalisation", "device", "precision", "training_images" (the run's own training data: a
        line says so), "teacher": {"error", "loss"}, "student": {...}}; error is the top-1 error (0..1), loss the
        mean cross-entropy.
    Raises:
        ConfigError, before any model is built, for each input that cannot work (see the helpers).
    """
    file, ckpt = load_checkpoint(checkpoint)
    try:
        cfg = TrainConfig.from_dict(ckpt["config"])
    except ConfigError as exc:
        raise ConfigError(f"--checkpoint's config does not load in this version of cowtune: {exc}") from None
    check(batch_size is None or batch_size >= 1, "--batch-size", "be >= 1", batch_size)
    dev = _device(device)
    images = find_images(data)
    record, source = (ckpt["data"], "recorded in the checkpoint") if "data" in ckpt else legacy_record(cfg, train_data)
    if train_data and "data" in ckpt:
        log("--train-data not used: the checkpoint records its class names and normalisation")
    labels = labels_for(images, record["class_names"])
    pipeline = eval_pipeline(images, labels, record, cfg, dev)
    own = trained_on(cfg, data, images)

    names = record["class_names"]
    bf16 = cfg.train.fast.bf16(dev.type)   # as trained
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16)
    fmt = torch.channels_last if cfg.train.fast.channels_last and dev.type == "cuda" else torch.contiguous_format
    fast = fast_path(cfg)
    scores: dict[str, dict[str, float]] = {}
    for name in ("teacher", "student"):
        model = create_model(cfg.model, len(names))
        if fast is not None:
            fast.prepare_model(model)   # the fast blocks, as the run evaluated (shake-shake: folded eval mode)
        try:
            model.load_state_dict(ckpt[name])
        except RuntimeError as exc:
            raise ConfigError(f"--checkpoint's {name} weights must fit model {cfg.model} with {len(names)} classes, "
                              f"got a mismatch ({str(exc).splitlines()[0]})") from None
        with torch.no_grad():
            batches = pipeline.eval_batches("test", batch_size or cfg.train.eval_batch_size)
            measured = evaluate(model.to(dev, memory_format=fmt), batches, autocast, fmt)
        scores[name] = {"error": measured.error, "loss": measured.loss}
        if measured.error5 is not None:
            scores[name]["error5"] = measured.error5

    scored = "every class folder" if not images.folder else f"{images.folder}/"
    if images.ignored:
        scored += f" (not {', '.join(f + '/' for f in images.ignored)})"
    result = {"checkpoint": str(file), "epoch": int(ckpt["epoch"]), "step": int(ckpt.get("step", 0)),
              "model": cfg.model, "method": cfg.method, "dataset": cfg.data.dataset, "data": data, "scored": scored,
              "images": len(labels), "classes": len(set(images.classes)), "class_names": names,
              "normalisation": {"mean": list(record["mean"]), "std": list(record["std"]), "source": source},
              "device": str(dev), "precision": "bf16" if bf16 else "fp32", "training_images": bool(own), **scores}
    _log_result(result, log)
    if own:
        log(own)
    return result


def _log_result(r: dict[str, Any], log: Callable[[str], None]) -> None:
    log(f"checkpoint {r['checkpoint']}: {r['model']}, {r['method']} on {r['dataset']}, epoch {r['epoch']}")
    log(f"scored {r['images']} images of {r['data']}: {r['scored']}, {r['classes']} of the model's "
        f"{len(r['class_names'])} classes (class order and normalisation {r['normalisation']['source']})")
    for name in ("teacher", "student"):
        top5 = f"  top-5 error {100 * r[name]['error5']:.2f}%" if "error5" in r[name] else ""
        log(f"{name}: error {100 * r[name]['error']:.2f}%{top5}  cross-entropy {r[name]['loss']:.4f}")
