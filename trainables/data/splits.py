"""Validation holdout and labeled subset (``make_splits``), stratified as in the reference
``small_image_data_source.py``, and the hashes that identify them: a dataset fingerprint
(``_fingerprint``, contents not location) mixed with the sorted indices.

Reference: "Milking CowMask for Semi-Supervised Image Classification", French, Oliver and
Salimans, arXiv:2003.12022, section 4.1.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from trainables.validation import ConfigError, check


@dataclass(frozen=True, eq=False)
class Splits:
    """Sorted int64 index arrays into the train split, and their hashes (16 hex chars each).

    The unlabeled pool is every non-validation image, so it contains the labeled subset.
    """
    val: np.ndarray
    labeled: np.ndarray
    unlabeled: np.ndarray
    hashes: dict[str, str]


def _fingerprint(name: str, labels: np.ndarray, extra: str = "") -> str:
    h = hashlib.sha256(np.ascontiguousarray(labels, dtype="<i8").tobytes() + extra.encode())
    return f"{name}|n={len(labels)}|{h.hexdigest()[:16]}"


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

    check(0 <= val_seed < 2 ** 32, "data.val_seed", "be between 0 and 2**32 - 1", val_seed)
    check(0 <= labeled_seed < 2 ** 32, "seed (or data.labeled_seed, which picks the labeled subset)",
          "be between 0 and 2**32 - 1", labeled_seed)
    labels = np.asarray(labels, dtype=np.int64)
    n, k = len(labels), len(np.unique(labels))
    if k < 2:
        raise ConfigError(f"the training split has {k} class{'es' if k != 1 else ''}: training needs at least 2 "
                          "classes")
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
