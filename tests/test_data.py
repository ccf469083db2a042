"""Tests for trainables/data/: splits, determinism, augmentation, ImageFolder trees, errors.

CPU only, no network, no dataset files: scikit-learn's digits and tiny PNG trees built in tmp_path.
"""
from __future__ import annotations

import copy
import dataclasses
import fcntl
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from trainables import data as D
from trainables.config import DataConfig
from trainables.data import image_files
from trainables.data.batches import _generator
from trainables.data.splits import make_splits
from trainables.validation import ConfigError

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def digits_raw() -> D.RawDataset:
    return D.load_raw(DataConfig(dataset="digits"))


@pytest.fixture(scope="module")
def digits() -> D.DeviceData:
    return D.prepare_data(DataConfig(dataset="digits", n_val=500, n_labeled=50), 0, CPU)


def _norm(raw: D.RawDataset, images: np.ndarray) -> torch.Tensor:
    """Reference normalisation of uint8 (N, H, W, C) -> float (N, C, H, W)."""
    x = torch.from_numpy(images).permute(0, 3, 1, 2).double() / 255.0
    mean = torch.tensor(raw.mean, dtype=torch.float64).view(1, -1, 1, 1)
    std = torch.tensor(raw.std, dtype=torch.float64).view(1, -1, 1, 1)
    return ((x - mean) / std).float()


# ------------------------------------------------------------------------------------------- splits

def test_splits_are_stratified_and_consistent(digits_raw):
    labels = digits_raw.train_labels
    s = D.make_splits(labels, n_val=500, val_seed=131, n_labeled=50, labeled_seed=1, fingerprint="digits")
    counts = np.bincount(labels, minlength=10)
    for idx, n in ((s.val, 500), (s.labeled, 50)):
        assert len(idx) == n and len(np.unique(idx)) == n
        expected = n * counts / counts.sum() if n == 500 else np.full(10, n / 10)
        assert np.all(np.abs(np.bincount(labels[idx], minlength=10) - expected) <= 1 + 1e-9)
    val, lab, unl = set(s.val), set(s.labeled), set(s.unlabeled)
    assert not val & lab and not val & unl and lab <= unl
    assert unl == set(range(len(labels))) - val
    assert all(np.all(np.diff(a) > 0) and a.dtype == np.int64 for a in (s.val, s.labeled, s.unlabeled))

    again = D.make_splits(labels, 500, 131, 50, 1, fingerprint="digits")
    assert again.hashes == s.hashes and all(len(h) == 16 for h in s.hashes.values())
    other = D.make_splits(labels, 500, 131, 50, 2, fingerprint="digits")
    assert np.array_equal(other.val, s.val) and other.hashes["val"] == s.hashes["val"]
    assert not np.array_equal(other.labeled, s.labeled) and other.hashes["labeled"] != s.hashes["labeled"]
    assert D.make_splits(labels, 500, 131, 50, 1, fingerprint="other").hashes["val"] != s.hashes["val"]


def test_split_edge_sizes(digits_raw):
    labels = digits_raw.train_labels
    s = D.make_splits(labels, n_val=0, val_seed=131, n_labeled=-1, labeled_seed=0)
    assert len(s.val) == 0 and len(s.labeled) == len(s.unlabeled) == len(labels)
    s = D.make_splits(labels, n_val=97, val_seed=131, n_labeled=len(labels) - 97, labeled_seed=0)
    assert np.array_equal(s.labeled, s.unlabeled)


@pytest.mark.parametrize("n_val, n_labeled, field, words", [
    (1797, 50, "data.n_val", "smaller than the training split (1797 images)"),
    (5000, 50, "data.n_val", "smaller than the training split"),
    (5, 50, "data.n_val", "number of classes"),
    (500, 1298, "data.n_labeled", "at most the 1297 images"),
    (500, 9, "data.n_labeled", "fewer than one label per class"),
    (500, 1290, "data.n_labeled", "stratified"),
])
def test_split_errors_name_the_field(digits_raw, n_val, n_labeled, field, words):
    with pytest.raises(ConfigError) as err:
        D.make_splits(digits_raw.train_labels, n_val, 131, n_labeled, 0)
    assert str(err.value).startswith(f"{field} must") and words in str(err.value)


def test_prepare_data_errors():
    with pytest.raises(ConfigError, match="data.n_labeled must .*fewer than one label per class"):
        D.prepare_data(DataConfig(dataset="digits", n_val=100, n_labeled=3), 0, CPU)
    with pytest.raises(ConfigError, match="data.eval_split must be 'val' for dataset 'digits'"):
        D.prepare_data(DataConfig(dataset="digits", n_val=100, n_labeled=50, eval_split="test"), 0, CPU)
    with pytest.raises(ConfigError, match="data.pad must be smaller than the image side"):
        D.prepare_data(DataConfig(dataset="digits", n_val=100, n_labeled=50, pad=32), 0, CPU)
    with pytest.raises(ConfigError, match="Unknown dataset 'digts'.*Did you mean 'digits'"):
        D.load_raw(DataConfig(dataset="digts"))


def test_registry_rejects_duplicates():
    assert {"cifar10", "cifar100", "svhn", "imagefolder", "digits"} <= set(D.DATASETS)
    with pytest.raises(ValueError, match="already registered"):
        D.register_dataset("digits")(lambda cfg: None)


def test_cifar10_missing_root_mentions_download(tmp_path):
    with pytest.raises(ConfigError) as err:
        D.load_raw(DataConfig(dataset="cifar10", root=str(tmp_path / "nothing")))
    assert "data.root" in str(err.value) and "data.download=true" in str(err.value)


# ------------------------------------------------------------------------------------ device pipeline

def test_interface_shapes_and_sizes(digits):
    assert digits.num_classes == 10 and digits.class_names == [str(i) for i in range(10)]
    assert digits.image_shape == (3, 32, 32)
    assert digits.sizes == {"train": 1797, "val": 500, "labeled": 50, "unlabeled": 1297, "test": 0}
    assert set(digits.split_hashes) == {"val", "labeled", "unlabeled"}
    assert digits.default_steps_per_epoch(256) == 1297 // 256 and digits.default_steps_per_epoch(4096) == 1
    assert "digits" in digits.describe() and "\n" not in digits.describe()
    batches = list(digits.train_batches(0, 0, 32, 3, augment_twice=False))
    assert len(batches) == 3
    b = batches[0]
    assert b.x_sup.shape == b.x_unsup0.shape == (32, 3, 32, 32) and b.y_sup.shape == (32,)
    assert b.x_sup.dtype == torch.float32 and b.y_sup.dtype == torch.int64
    assert b.x_unsup1 is b.x_unsup0


def test_train_batches_are_a_pure_function_of_epoch_and_seed(digits):
    def run(epoch, seed, twice=True):
        return [dataclasses.astuple(b) for b in digits.train_batches(epoch, seed, 64, 4, twice)]
    a, b = run(3, 7), run(3, 7)
    assert all(torch.equal(x, y) for ba, bb in zip(a, b) for x, y in zip(ba, bb))
    other_epoch, other_seed = run(4, 7), run(3, 8)
    assert not torch.equal(a[0][0], other_epoch[0][0]) and not torch.equal(a[0][2], other_epoch[0][2])
    assert not torch.equal(a[0][0], other_seed[0][0])
    assert not torch.equal(a[0][2], a[0][3])          # augment_twice: independent views
    torch.manual_seed(0)
    g0 = torch.get_rng_state()
    run(3, 7)
    assert torch.equal(torch.get_rng_state(), g0)    # global RNG untouched


@pytest.mark.parametrize("twice", [False, True])
def test_batches_do_not_depend_on_how_many_steps_are_augmented_at_once(digits, twice, monkeypatch):
    def run(chunk):
        d = copy.copy(digits)
        d.chunk_steps = chunk
        return list(d.train_batches(2, 5, 16, 7, twice))
    one = run(1)
    for chunk in (3, 8):   # 7 steps: a short last chunk, and one chunk longer than the epoch
        for a, b in zip(one, run(chunk), strict=True):
            assert all(torch.equal(x, y) for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b)))
            assert (b.x_unsup1 is b.x_unsup0) is not twice
    step_bytes = (3 if twice else 2) * 16 * 3 * 32 * 32 * 4
    monkeypatch.setattr(D.device, "CHUNK_BYTES", 2 * step_bytes + 1)   # chunks of 2 steps at most
    for a, b in zip(one, run(8), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b)))
        assert b.x_sup.untyped_storage().nbytes() <= 2 * step_bytes


def test_every_chunk_is_augmented_at_one_size(digits, monkeypatch):
    """A short last chunk is augmented as a whole one (its first views again), so the compiled augmentation meets
    one shape per run and does not compile again at the end of the first epoch."""
    sizes = []
    augment = D.device.augment
    monkeypatch.setattr(D.device, "augment", lambda images, idx, *rest: sizes.append(len(idx)) or augment(images, idx, *rest))
    d = copy.copy(digits)
    d.chunk_steps = 3
    assert len(list(d.train_batches(0, 1, 16, 7, False))) == 7
    assert sizes == [3 * 2 * 16] * 3   # 3 chunks of 3 steps x 2 views, the last one steps 4-6 (step 6 new)


def _batches_view_by_view(d, epoch: int, seed: int, b: int, steps: int, twice: bool):
    """A reference: each step's views augmented one by one from the pipeline's draws (its order of labeled and
    unlabeled images, then crop offsets and flips for every view, step and image)."""
    from trainables.data.batches import epoch_order

    n = steps * b
    sup = epoch_order(d._index["labeled"], n, _generator(seed, epoch, "labeled", CPU)).view(steps, b)
    unsup = epoch_order(d._index["unlabeled"], n, _generator(seed, epoch, "unlabeled", CPU)).view(steps, b)
    views = 3 if twice else 2
    oy, ox, flips = D.device.crop_flip_params((views, steps, b), d.pad, d.flip, _generator(seed, epoch, "augment", CPU))

    def view(v, idx, s):
        return D.device.augment(d.images, idx[s], oy[v, s], ox[v, s], flips[v, s], d.pad, d._scale, d._shift)

    for s in range(steps):
        u0 = view(1, unsup, s)
        yield view(0, sup, s), d.labels[sup[s]], u0, view(2, unsup, s) if twice else u0


@pytest.mark.parametrize("twice", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_chunked_batches_are_the_views_made_one_by_one(digits, twice, chunk):
    """All views of a chunk come from one gather laid out (step, view, B, ...); each is the one its own draws
    give, also in a short last chunk."""
    d = copy.copy(digits)
    d.chunk_steps = chunk
    for got, want in zip(d.train_batches(2, 7, 16, 7, twice), _batches_view_by_view(d, 2, 7, 16, 7, twice), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(dataclasses.astuple(got), want))


@pytest.mark.parametrize("twice", [False, True])
def test_a_steps_views_lie_back_to_back(digits, twice):
    """A captured step copies a step's images into its inputs at once when they lie one after the other in one
    storage (trainables.fast.step_graph.back_to_back), as the device pipeline lays them out; a batch put together from
    separate tensors is copied view by view."""
    from trainables.fast.step_graph import back_to_back

    for b in digits.train_batches(0, 1, 16, 5, twice):
        views = [b.x_sup, b.x_unsup0] + ([b.x_unsup1] if twice else [])
        assert (b.x_unsup1 is b.x_unsup0) != twice
        block = back_to_back(views)
        assert block is not None and block.shape == (len(views), *b.x_sup.shape)
        assert all(torch.equal(block[i], v) for i, v in enumerate(views))
        assert back_to_back([b.x_sup.clone(), b.x_unsup0.clone()]) is None
        assert back_to_back([b.x_unsup0, b.x_sup]) is None   # the wrong order


def test_compiled_augmentation_gives_the_eager_views(digits):
    """On a GPU the views are augmented under torch.compile (its default there); the same views as eagerly, up to
    the rounding of a fused multiply-add in the normalisation."""
    assert not digits.compiled   # CPU: eager by default
    assert D.prepare_data(DataConfig(dataset="digits", n_val=100, n_labeled=20), 0, CPU, compiled=True).compiled
    compiled = copy.copy(digits)
    compiled.compiled = True
    for a, b in zip(digits.train_batches(1, 3, 16, 3, True), compiled.train_batches(1, 3, 16, 3, True), strict=True):
        for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b)):
            torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-6)


def test_a_chunk_of_no_steps_is_refused(digits_raw):
    splits = make_splits(digits_raw.train_labels, 0, 10, 50, 0, digits_raw.fingerprint)
    with pytest.raises(ConfigError, match="chunk_steps"):
        D.DeviceData(digits_raw, splits, True, 4, CPU, chunk_steps=0)


def test_sampling_cycles_labeled_set_and_permutes_unlabeled(digits):
    steps, bs = 20, 64                                 # 1,280 draws: 25.6 passes of the 50 labels
    labeled = set(digits.splits.labeled.tolist())
    seen = [b.y_sup for b in digits.train_batches(0, 1, bs, steps, False)]
    # the order train_batches draws: rebuilt from the same stream to check the sampling itself
    gen = _generator(1, 0, "labeled", CPU)
    order = D.epoch_order(torch.from_numpy(digits.splits.labeled), steps * bs, gen).numpy()
    assert set(order.tolist()) == labeled
    counts = np.bincount(order, minlength=1797)[sorted(labeled)]
    assert counts.max() - counts.min() <= 1
    assert torch.equal(torch.cat(seen), digits.labels[torch.from_numpy(order)])
    unl = D.epoch_order(torch.from_numpy(digits.splits.unlabeled), 1297, _generator(1, 0, "unlabeled", CPU))
    assert sorted(unl.tolist()) == digits.splits.unlabeled.tolist()


def test_eval_batches_are_normalised_raw_images(digits, digits_raw):
    xs, ys = zip(*digits.eval_batches("val", 128))
    assert [len(y) for y in ys] == [128, 128, 128, 116]
    x, y = torch.cat(xs), torch.cat(ys)
    val = digits.splits.val
    assert torch.equal(y, torch.from_numpy(digits_raw.train_labels[val]))
    assert torch.allclose(x, _norm(digits_raw, digits_raw.train_images[val]), atol=1e-5)
    assert x.mean((0, 2, 3)).abs().max() < 0.2
    most = D.prepare_data(DataConfig(dataset="digits", n_val=1700, n_labeled=-1), 0, CPU)
    x = torch.cat([x for x, _ in most.eval_batches("val", 1000)])
    assert x.shape[0] == 1700 and x.mean((0, 2, 3)).abs().max() < 0.2
    assert torch.allclose(x.std((0, 2, 3)), torch.ones(3), atol=0.2)
    with pytest.raises(ConfigError, match="data.eval_split must be 'val' for a dataset without a test split"):
        most.eval_batches("test", 10)


def test_gather_crops_equals_reflect_pad_and_slice():
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (10, 3, 12, 16), generator=gen, dtype=torch.uint8)
    idx = torch.tensor([3, 0, 9, 3, 5, 5, 1, 2])
    pad = 4
    oy, ox, flips = D.crop_flip_params((8,), pad, True, gen)
    assert flips.any() and not flips.all()
    out = D.gather_crops(images, idx, D.window_indices(oy, 12, pad), D.window_indices(ox, 16, pad, flips))
    padded = F.pad(images.float(), (pad,) * 4, mode="reflect")
    for b in range(8):
        ref = padded[idx[b], :, oy[b]:oy[b] + 12, ox[b]:ox[b] + 16]
        ref = ref.flip(-1) if flips[b] else ref
        assert torch.equal(out[b].float(), ref)


def test_train_view_is_a_window_of_the_padded_labeled_image(digits, digits_raw):
    """End to end: each x_sup is a crop (maybe flipped) of the reflect-padded image of its label."""
    pad = 4
    dev = D.prepare_data(DataConfig(dataset="digits", n_val=500, n_labeled=50, flip=True, pad=pad), 0, CPU)
    labeled = dev.splits.labeled
    padded = F.pad(_norm(digits_raw, digits_raw.train_images[labeled]), (pad,) * 4, mode="reflect")
    windows = padded.unfold(2, 32, 1).unfold(3, 32, 1)           # (L, C, 9, 9, 32, 32)
    windows = windows.permute(0, 2, 3, 1, 4, 5).reshape(len(labeled), 81, 3, 32, 32)
    windows = torch.cat([windows, windows.flip(-1)], 1)            # (L, 162, C, H, W)
    batch = next(iter(dev.train_batches(0, 5, 16, 1, False)))
    for x, y in zip(batch.x_sup, batch.y_sup):
        diff = (windows - x).abs().flatten(2).amax(-1)            # (L, 162)
        hit = (diff < 1e-5).nonzero()
        assert len(hit) > 0
        assert all(digits_raw.train_labels[labeled[i]] == y for i in hit[:, 0].tolist())


def test_flip_off_never_flips_and_on_flips(digits_raw):
    def views(flip):
        d = D.prepare_data(DataConfig(dataset="digits", n_val=100, n_labeled=50, flip=flip, pad=0), 0, CPU)
        raw = _norm(digits_raw, digits_raw.train_images)[:, 0].flatten(1)                 # (N, H*W)
        x = torch.cat([torch.cat([b.x_sup, b.x_unsup0]) for b in d.train_batches(0, 0, 128, 2, False)])
        dist = torch.cdist(x[:, 0].flatten(1), raw, compute_mode="donot_use_mm_for_euclid_dist")
        return (dist.amin(1) < 1e-4).tolist()
    assert all(views(False))                  # pad 0, no flip: every view is an untouched image
    assert not all(views(True))               # with flips some views match no image as stored


# --------------------------------------------------------------------------------------- imagefolder

def _write_tree(root: Path, classes: int, per_class: int, size: int, split_dirs: bool, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for split in (("train", "test") if split_dirs else ("",)):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class if split != "test" else 2):
                base = np.array([80 * c, 255 - 60 * c, 40 + 10 * i], dtype=np.int16)
                img = np.clip(base + rng.integers(-30, 30, (size, size, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(img).save(folder / f"{i:03d}.png")


def _zip_tree(root: Path, out: Path) -> Path:
    with zipfile.ZipFile(out, "w") as z:
        for p in sorted(root.rglob("*.png")):
            z.write(p, p.relative_to(root).as_posix())
    return out


def test_imagefolder_folder_and_zip_on_device_with_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COWTUNE_CACHE", str(tmp_path / "cache"))
    tree = tmp_path / "tree"
    _write_tree(tree, classes=3, per_class=12, size=32, split_dirs=True)
    zipped = _zip_tree(tree, tmp_path / "tree.zip")
    cfg = DataConfig(dataset="imagefolder", root=str(tree), n_val=6, n_labeled=6, eval_split="test")
    a = D.prepare_data(cfg, 0, CPU)
    b = D.prepare_data(dataclasses.replace(cfg, root=str(zipped)), 0, CPU)
    for d in (a, b):
        assert isinstance(d, D.DeviceData) and d.class_names == ["class0", "class1", "class2"]
        assert d.sizes == {"train": 36, "val": 6, "labeled": 6, "unlabeled": 30, "test": 6}
        assert d.image_shape == (3, 32, 32)
    assert a.split_hashes == b.split_hashes                  # same tree, same fingerprint
    assert torch.equal(a.images, b.images) and torch.equal(a.test_images, b.test_images)
    first = np.array(Image.open(tree / "train" / "class1" / "000.png"))
    assert torch.equal(a.images[12], torch.from_numpy(first).permute(2, 0, 1))   # sorted class, file order
    x, y = next(a.eval_batches("test", 100))
    assert x.shape == (6, 3, 32, 32) and y.tolist() == [0, 0, 1, 1, 2, 2]
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 2

    def no_decode(*args, **kwargs):
        raise AssertionError("decoded again instead of reading the cache")
    monkeypatch.setattr(image_files, "_decode_all", no_decode)   # looked up by _decode_cached there
    again = D.prepare_data(dataclasses.replace(cfg, root=str(zipped)), 0, CPU)
    assert torch.equal(again.images, b.images) and again.split_hashes == b.split_hashes
    (tmp_path / "link.zip").symlink_to(zipped)                   # the same zip through a link: the same cache
    linked = D.prepare_data(dataclasses.replace(cfg, root=str(tmp_path / "link.zip")), 0, CPU)
    assert torch.equal(linked.images, b.images) and len(list((tmp_path / "cache").glob("*.npz"))) == 2


def test_imagefolder_plain_class_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("COWTUNE_CACHE", str(tmp_path / "cache"))
    _write_tree(tmp_path / "wrap" / "tree", classes=3, per_class=6, size=16, split_dirs=False)
    zipped = _zip_tree(tmp_path / "wrap", tmp_path / "t.zip")          # members tree/class*/...
    d = D.prepare_data(DataConfig(dataset="imagefolder", root=str(zipped), n_val=3, n_labeled=3, pad=2), 0, CPU)
    assert d.class_names == ["class0", "class1", "class2"] and d.sizes["test"] == 0 and d.image_shape == (3, 16, 16)
    assert next(iter(d.train_batches(0, 0, 4, 1, False))).x_sup.shape == (4, 3, 16, 16)


def test_imagefolder_mixed_sizes_rejected_for_device(tmp_path, monkeypatch):
    monkeypatch.setenv("COWTUNE_CACHE", str(tmp_path / "cache"))
    _write_tree(tmp_path / "tree", classes=2, per_class=4, size=16, split_dirs=False)
    Image.new("RGB", (20, 16)).save(tmp_path / "tree" / "class1" / "999.png")
    with pytest.raises(ConfigError, match="data.root must hold images of one size"):
        D.prepare_data(DataConfig(dataset="imagefolder", root=str(tmp_path / "tree"), n_val=2, n_labeled=2), 0, CPU)
    with pytest.raises(ConfigError, match="data.root must be an ImageFolder tree"):
        D.prepare_data(DataConfig(dataset="imagefolder", root=str(tmp_path / "missing")), 0, CPU)


def test_decode_in_worker_processes_matches_one_process(tmp_path):
    """Large sets are decoded by ``python -m trainables.data.image_decode`` workers over contiguous ranges:
    the same array as one process, from a folder and a zip, and a wrong-sized image found at its position."""
    from trainables.data.image_decode import decode_images

    tree = tmp_path / "tree"
    _write_tree(tree, classes=3, per_class=7, size=16, split_dirs=False)
    zipped = _zip_tree(tree, tmp_path / "t.zip")
    names = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*.png"))
    one, bad = decode_images(str(tree), names, (16, 16), workers=1)
    assert bad is None and one.shape == (21, 16, 16, 3) and one.dtype == np.uint8
    assert np.array_equal(one[8], np.array(Image.open(tree / names[8])))
    for root in (str(tree), str(zipped)):
        many, bad = decode_images(root, names, (16, 16), workers=3)
        assert bad is None and np.array_equal(many, one)
    Image.new("RGB", (20, 16)).save(tree / "class2" / "003.png")   # position 17, in the third worker's range
    for workers in (1, 3):
        part, bad = decode_images(str(tree), names, (16, 16), workers=workers)
        assert bad == (17, (20, 16)) and np.array_equal(part, one[:17])
    with pytest.raises(ConfigError, match="class2/003.png is 20x16"):
        image_files._decode_all(image_files.FileImages(str(tree), np.array(names)), "tree", workers=3)


def test_loader_pipeline_large_images(tmp_path):
    tree = tmp_path / "big"
    _write_tree(tree, classes=2, per_class=6, size=80, split_dirs=False)
    cfg = DataConfig(dataset="imagefolder", root=str(tree), n_val=2, n_labeled=4, image_size=64, workers=0,
                     colour_jitter=True)
    d = D.prepare_data(cfg, 0, CPU)
    assert isinstance(d, D.LoaderData) and d.image_shape == (3, 64, 64)
    assert d.sizes == {"train": 12, "val": 2, "labeled": 4, "unlabeled": 10, "test": 0}
    first = list(d.train_batches(1, 3, 4, 2, augment_twice=True))
    assert len(first) == 2
    b = first[0]
    assert b.x_sup.shape == b.x_unsup0.shape == b.x_unsup1.shape == (4, 3, 64, 64)
    assert b.x_sup.dtype == torch.float32 and b.y_sup.dtype == torch.int64
    assert not torch.equal(b.x_unsup0, b.x_unsup1)
    second = list(d.train_batches(1, 3, 4, 2, augment_twice=True))
    assert all(torch.equal(p, q) for x, y in zip(first, second)
               for p, q in zip(dataclasses.astuple(x), dataclasses.astuple(y)))
    assert not torch.equal(b.x_sup, next(iter(d.train_batches(2, 3, 4, 1, True))).x_sup)
    once = next(iter(d.train_batches(1, 3, 4, 1, augment_twice=False)))
    assert once.x_unsup1 is once.x_unsup0
    x, y = next(d.eval_batches("val", 10))
    assert x.shape == (2, 3, 64, 64) and torch.equal(y, torch.from_numpy(np.array([0, 1])))
    # two workers give the same batches as none (per-sample generators)
    workers = D.prepare_data(dataclasses.replace(cfg, workers=2), 0, CPU)
    par = list(workers.train_batches(1, 3, 4, 2, augment_twice=True))
    assert all(torch.equal(p, q) for x, y in zip(first, par)
               for p, q in zip(dataclasses.astuple(x), dataclasses.astuple(y)))


def test_a_search_driver_warms_the_decode_cache_and_trials_wait_for_a_decoding(tmp_path, monkeypatch):
    monkeypatch.setenv("COWTUNE_CACHE", str(tmp_path / "cache"))
    _write_tree(tmp_path / "tree", classes=2, per_class=5, size=16, split_dirs=False)
    cfg = DataConfig(dataset="imagefolder", root=str(tmp_path / "tree"), n_val=2, n_labeled=2)
    assert D.warm_decode_cache(DataConfig(dataset="digits")) is None            # nothing to decode
    D.warm_decode_cache(dataclasses.replace(cfg, root=str(tmp_path / "missing"))).join()   # errors: left to trials
    D.warm_decode_cache(cfg).join(timeout=60)
    (cache,) = (tmp_path / "cache").glob("*.npz")
    # while another process decodes (holds the lock), a trial waits, then decodes if no cache came of it
    cache.unlink()
    with open(cache.with_suffix(".lock"), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        loaded = []
        waiter = threading.Thread(target=lambda: loaded.append(D.load_raw(cfg)))
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and not cache.exists()
        fcntl.flock(held, fcntl.LOCK_UN)
    waiter.join(timeout=60)
    assert cache.exists() and loaded[0].train_images.shape == (10, 16, 16, 3)

    def no_decode(*args, **kwargs):
        raise AssertionError("decoded again instead of reading the cache")
    monkeypatch.setattr(image_files, "_decode_all", no_decode)
    assert np.array_equal(D.load_raw(cfg).train_images, loaded[0].train_images)


def _zip_with_a_truncated_jpeg(path: Path, per_class: int = 100, bad: str = "train/b/007.jpg") -> Path:
    rng = np.random.default_rng(0)
    with zipfile.ZipFile(path, "w") as z:
        for c in ("a", "b", "c"):
            for i in range(per_class):
                buf = __import__("io").BytesIO()
                Image.fromarray((rng.random((32, 32, 3)) * 255).astype(np.uint8)).save(buf, "JPEG")
                name = f"train/{c}/{i:03d}.jpg"
                z.writestr(name, buf.getvalue()[: len(buf.getvalue()) // 3] if name == bad else buf.getvalue())
    return path


@pytest.mark.parametrize("workers", [1, 2])
def test_an_image_that_cannot_be_decoded_is_named(tmp_path, workers, monkeypatch):
    """A truncated JPEG: one line naming the file (in one process or several), not a traceback naming none."""
    from trainables.data.image_decode import decode_images
    root = _zip_with_a_truncated_jpeg(tmp_path / "bad.zip")
    names = sorted(n for n in zipfile.ZipFile(root).namelist() if n.endswith(".jpg"))
    _, bad = decode_images(str(root), names, (32, 32), workers)
    assert names[bad[0]] == "train/b/007.jpg" and "Truncated" in bad[1]
    monkeypatch.setenv("COWTUNE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"holds an image that cannot be decoded, train/b/007\.jpg \(OSError"):
        D.load_raw(DataConfig(dataset="imagefolder", root=str(root)))
    assert not list((tmp_path / "cache").glob("*.npz"))   # nothing cached


def test_images_that_cannot_be_decoded_are_left_out_when_asked(tmp_path, monkeypatch, capsys):
    """data.unreadable=skip: a truncated file and one that is not an image (the very first file, whose header
    sets the image size) are left out and named; every other image keeps its own class label, as does the cache."""
    monkeypatch.setenv("COWTUNE_CACHE", str(tmp_path / "cache"))
    tree = tmp_path / "tree"
    _write_tree(tree, classes=3, per_class=8, size=16, split_dirs=False)
    (tree / "class0" / "000.png").write_bytes(b"not an image")
    good = (tree / "class2" / "005.png").read_bytes()
    (tree / "class2" / "005.png").write_bytes(good[: len(good) // 2])
    cfg = DataConfig(dataset="imagefolder", root=str(tree), n_val=0, eval_split="test", unreadable="skip")
    with pytest.raises(ConfigError, match=r"class0/000\.png .*or leave such files out with --set data.unreadable=skip"):
        D.load_raw(dataclasses.replace(cfg, unreadable="stop"))
    for _ in range(2):   # decoded, then from the cache
        raw = D.load_raw(cfg)
        assert len(raw.train_images) == len(raw.train_labels) == 22
        assert np.bincount(raw.train_labels).tolist() == [7, 8, 7]
        # each kept image is its own class's colour (class c's red channel is about 80 c)
        red = raw.train_images[..., 0].reshape(22, -1).mean(axis=1)
        assert all(abs(r - 80 * y) < 35 for r, y in zip(red, raw.train_labels))
    assert "skipped 2 image files of" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="data.unreadable must be 'stop' or 'skip', got 'ignore'"):
        DataConfig(unreadable="ignore")


def test_linked_class_folders_are_read_once_and_a_broken_link_is_left_out_when_asked(tmp_path, monkeypatch, capsys):
    """Class folders that are symbolic links to folders elsewhere are read (each image once, as os.walk read
    them); a link back up the tree is refused, not followed until the OS stops it (60 images became 2,460); a
    broken link to an image is left out and named with data.unreadable=skip, as an image that cannot be decoded."""
    monkeypatch.setenv("COWTUNE_CACHE", str(tmp_path / "cache"))
    _write_tree(tmp_path / "elsewhere", classes=3, per_class=4, size=16, split_dirs=False)
    (tmp_path / "tree").mkdir()
    for c in range(3):
        (tmp_path / "tree" / f"class{c}").symlink_to(tmp_path / "elsewhere" / f"class{c}")
    (tmp_path / "elsewhere" / "class1" / "zzz.png").symlink_to("gone.png")
    cfg = DataConfig(dataset="imagefolder", root=str(tmp_path / "tree"), n_val=3, unreadable="skip")
    assert D.check_source(cfg) == 13   # the broken link is listed, for the decoding to leave out
    raw = D.load_raw(cfg)
    assert len(raw.train_images) == 12 and np.bincount(raw.train_labels).tolist() == [4, 4, 4]
    assert "skipped 1 image file of" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"class1/zzz\.png \(a broken symbolic link, to gone\.png\)"):
        D.check_source(dataclasses.replace(cfg, unreadable="stop"))   # the driver's check names it, too
    (tmp_path / "elsewhere" / "class2" / "up").symlink_to("../../tree")
    with pytest.raises(ConfigError, match="holds a symbolic link loop: class2/up leads back to the root"):
        D.load_raw(cfg)


def test_a_split_needs_two_classes_and_seeds_numpy_can_take():
    labels = np.zeros(10, dtype=np.int64)
    with pytest.raises(ConfigError, match="the training split has 1 class: training needs at least 2 classes"):
        make_splits(labels, 0, 131, -1, 0)
    with pytest.raises(ConfigError, match=r"data.val_seed must be between 0 and 2\*\*32 - 1, got -1"):
        make_splits(np.arange(10) % 2, 2, -1, -1, 0)
