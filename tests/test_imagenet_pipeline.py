"""The large-image pipeline on the device (``trainables.data.gpu_decode``, ``DecodedData``), run here on CPU tensors,
against the PIL path (``trainables.data.loader``) by the statistics of what each produces, on real JPEG files; and the
hybrid of the two (``HybridData``, ``data.decode: hybrid``): its rows are each path's own rows, bit for bit.

Tolerances (stated once): crop area and aspect distributions, two-sample Kolmogorov-Smirnov distance < 0.06 over
2,000 crops each (the 0.1% critical value is 0.062); flip rate 0.5 +- 0.04 over 2,000; the same crop resized by
both: mean absolute difference < 1 grey level of 255; the whole train view over 384 random crops: per-channel mean
within 4 standard errors (of the per-crop means) + 0.5 levels and std within 5%; the eval view: mean absolute
difference < 2 levels; the hybrid batch's host rows against its device rows over 384 views: as the train views.
"""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from trainables import data as D
from trainables.config import DataConfig
from trainables.data import gpu_decode as G
from trainables.data.loader import _colour_jitter, eval_view, inception_box, train_view
from trainables.validation import ConfigError

CPU = torch.device("cpu")


def scene(w: int, h: int, seed: int) -> np.ndarray:
    """A photo-like RGB uint8 (h, w, 3): gradients, a few discs, texture and noise (not white noise, whose every
    crop looks alike)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.stack([xx * 255 / w, yy * 255 / h, 128 + 90 * np.sin(xx / (9 + seed % 7)) * np.cos(yy / 13.0)], -1)
    for _ in range(4):
        cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(20, 120)
        img[(xx - cx) ** 2 + (yy - cy) ** 2 < r * r] = rng.uniform(0, 255, 3)
    return np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)


def jpeg(a: np.ndarray, mode: str = "RGB", quality: int = 90) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).convert(mode).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


@pytest.fixture(scope="module")
def blobs() -> list[bytes]:
    return [jpeg(scene(*((500, 375) if i % 3 else (375, 500)), i)) for i in range(12)]


@pytest.fixture(scope="module")
def jpeg_tree(tmp_path_factory, blobs):
    root = tmp_path_factory.mktemp("imagenet_like")
    for i, b in enumerate(blobs * 2):
        folder = root / "train" / f"n{i % 4:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i}.JPEG").write_bytes(b)
    return root


def ks(a: np.ndarray, b: np.ndarray) -> float:
    from scipy.stats import ks_2samp
    return float(ks_2samp(a, b).statistic)


@pytest.mark.parametrize("size", [(500, 375), (375, 500), (64, 48)])
def test_the_crops_of_both_paths_have_the_same_area_and_aspect_distributions(size):
    n, gen = 2000, torch.Generator().manual_seed(1)
    pil = np.array([inception_box(*size, gen) for _ in range(n)], dtype=np.float64)   # left, top, right, bottom
    pil_w, pil_h = pil[:, 2] - pil[:, 0], pil[:, 3] - pil[:, 1]
    sizes = torch.tensor([size] * n)
    boxes = G.inception_boxes(sizes, G.crop_uniforms(n, torch.Generator().manual_seed(2)))
    area, aspect = (t.numpy() for t in G.area_and_aspect(boxes, sizes))
    assert ks(pil_w * pil_h / (size[0] * size[1]), area) < 0.06
    assert ks(pil_w / pil_h, aspect) < 0.06
    # the rule itself: inside the image, 10..100% of its area (min_object_covered), aspect 0.75..1.33 up to rounding
    left, top, w, h = boxes.T.numpy()
    assert (left >= 0).all() and (top >= 0).all() and (left + w <= size[0]).all() and (top + h <= size[1]).all()
    assert area.min() >= 0.1 and area.max() <= 1.0 and np.median(area) < 0.6
    assert 0.7 < aspect.min() and aspect.max() < 1.4


def test_an_image_no_crop_fits_falls_back_to_the_whole_image_in_both_paths():
    """400x20: an aspect of 0.75..1.33 at most 20 high covers under 10% of it, so all 100 attempts fail."""
    gen = torch.Generator().manual_seed(0)
    assert inception_box(400, 20, gen) == (0, 0, 400, 20)
    boxes = G.inception_boxes(torch.tensor([[400, 20]] * 50), G.crop_uniforms(50, gen))
    assert boxes.tolist() == [[0, 0, 400, 20]] * 50


def test_flip_rates_agree():
    gen = torch.Generator().manual_seed(3)
    pil = np.mean([int(torch.randint(0, 2, (), generator=gen)) for _ in range(2000)])
    flips = torch.rand(2000, generator=torch.Generator().manual_seed(4)) < 0.5
    assert abs(pil - 0.5) < 0.04 and abs(flips.double().mean().item() - 0.5) < 0.04
    x = torch.arange(12.0).view(1, 1, 3, 4).expand(2, 3, 3, 4)
    out = G.flip_(x, torch.tensor([True, False]))
    assert torch.equal(out[0], x[0].flip(2)) and torch.equal(out[1], x[1])


def test_decoding_and_one_crop_resized_agree_with_pil(blobs):
    decoded = G.Decoder(CPU)(blobs[:4])
    for b, t in zip(blobs[:4], decoded):
        pil = np.asarray(Image.open(io.BytesIO(b)).convert("RGB"))
        assert np.abs(t.permute(1, 2, 0).numpy().astype(int) - pil.astype(int)).max() <= 1   # both libjpeg
    boxes = torch.tensor([[10, 20, 300, 250], [0, 0, 375, 375], [100, 50, 80, 60], [5, 5, 200, 180]])
    ours = G.to_uint8(G.crop_resize(decoded, boxes, 96)).numpy().astype(int)
    for k, (b, (l, t, w, h)) in enumerate(zip(blobs[:4], boxes.tolist())):
        img = Image.open(io.BytesIO(b)).convert("RGB")
        pil = np.asarray(img.resize((96, 96), Image.BICUBIC, box=(l, t, l + w, t + h))).transpose(2, 0, 1)
        assert np.abs(ours[k] - pil.astype(int)).mean() < 1.0, k


def test_colour_jitter_with_the_same_factors_agrees_with_pil(blobs):
    img = Image.open(io.BytesIO(blobs[1])).convert("RGB").resize((64, 64), Image.BICUBIC)
    x = torch.from_numpy(np.array(img)).permute(2, 0, 1)[None].float()
    for seed in range(6):
        gen = torch.Generator().manual_seed(seed)
        pil = np.asarray(_colour_jitter(img, gen)).transpose(2, 0, 1).astype(float)
        gen = torch.Generator().manual_seed(seed)   # the PIL path's draws: its order, then each op's factor
        order = torch.randperm(4, generator=gen)
        lo, width = [0.7, -0.1, 0.7, 0.6], [0.7, 0.2, 0.7, 0.8]
        u = [0.0] * 4
        for k in order.tolist():
            u[k] = lo[k] + width[k] * _u(gen)
        factors = torch.tensor([u])
        ours = G.colour_jitter(x.clone(), factors, order[None]).round()[0].numpy()
        assert np.abs(ours - pil).mean() < 2.5, seed


def _u(gen: torch.Generator) -> float:
    return float(torch.rand((), generator=gen, dtype=torch.float64))


@pytest.mark.parametrize("jitter", [False, True])
def test_train_views_of_both_paths_have_the_same_pixel_statistics(jitter):
    n, size = 384, 48
    blobs = [jpeg(scene(*((250, 188) if i % 3 else (188, 250)), i)) for i in range(12)]   # smaller: CPU time
    images = [Image.open(io.BytesIO(b)).convert("RGB") for b in blobs]
    gen = torch.Generator().manual_seed(5)
    pil = torch.stack([train_view(images[i % len(images)], size, True, jitter, gen) for i in range(n)]).double()
    decoded = G.Decoder(CPU)(blobs)
    picks = [decoded[i % len(blobs)] for i in range(n)]
    gen = torch.Generator().manual_seed(6)
    x = G.crop_resize(picks, G.inception_boxes(G.image_sizes(picks), G.crop_uniforms(n, gen)), size)
    x = G.flip_(x, torch.rand(n, generator=gen) < 0.5)
    if jitter:
        x = G.colour_jitter(x, *G.jitter_params(n, gen))
    ours = G.to_uint8(x).double()
    for c in range(3):   # the crops are random: the means' gap against its standard error (per-crop means)
        a, b = pil[:, c].mean((1, 2)), ours[:, c].mean((1, 2))
        se = (a.var() / n + b.var() / n).sqrt()
        assert abs(a.mean() - b.mean()) < 4 * se + 0.5, (c, a.mean(), b.mean(), se)
        assert abs(pil[:, c].std() / ours[:, c].std() - 1) < 0.05, c


def test_eval_views_agree(blobs):
    decoded = G.Decoder(CPU)(blobs[:6])
    ours = G.to_uint8(G.crop_resize(decoded, G.centre_boxes(G.image_sizes(decoded)), 80)).double()
    pil = torch.stack([eval_view(Image.open(io.BytesIO(b)).convert("RGB"), 80) for b in blobs[:6]]).double()
    assert (ours - pil).abs().mean() < 2.0


def test_greyscale_cmyk_and_png_files_are_decoded_to_rgb_and_said_once(capsys):
    a = scene(60, 40, 0)
    png = io.BytesIO()
    Image.fromarray(a).save(png, "PNG")
    blobs = [jpeg(a), jpeg(a, "L"), jpeg(a, "CMYK"), png.getvalue()]
    assert [G.jpeg_header(b) for b in blobs] == [(60, 40, 3), (60, 40, 1), (60, 40, 4), None]
    decoder = G.Decoder(CPU, "tree")
    out = decoder(blobs)
    assert [tuple(t.shape) for t in out] == [(3, 40, 60)] * 4 and all(t.dtype == torch.uint8 for t in out)
    assert torch.equal(out[1][0], out[1][2])                                  # grey: three equal channels
    assert np.abs(out[3].permute(1, 2, 0).numpy().astype(int) - a).max() == 0   # PNG: lossless
    decoder(blobs)
    err = capsys.readouterr().err
    assert err.count("cowtune:") == 1 and "2 of 4 images" in err and "not baseline RGB or greyscale JPEGs" in err


def test_the_device_path_is_chosen_by_data_decode_and_keeps_the_loader_paths_order(jpeg_tree):
    cfg = lambda decode: DataConfig(dataset="imagefolder", root=str(jpeg_tree), n_val=4, n_labeled=8, decode=decode,
                                    workers=0, image_size=64)
    pil, ours = D.prepare_data(cfg("pil"), 0, CPU), D.prepare_data(cfg("device"), 0, CPU)
    auto = D.prepare_data(cfg("auto"), 0, CPU)   # auto on a CPU: PIL
    assert type(pil) is D.LoaderData and type(auto) is D.LoaderData and type(ours) is D.DecodedData
    assert D.resolve_decode("auto", ours._files["train"], torch.device("cuda")) == ("hybrid", "")
    assert "decoded on cpu (libjpeg" in ours.describe() and ours.pipeline == "loader"
    (a,), (b,) = list(pil.train_batches(0, 0, 8, 1, False)), list(ours.train_batches(0, 0, 8, 1, False))
    assert torch.equal(a.y_sup, b.y_sup) and b.x_sup.shape == (8, 3, 64, 64) and b.x_unsup1 is b.x_unsup0
    ((xa, ya),), ((xb, yb),) = list(pil.eval_batches("val", 10)), list(ours.eval_batches("val", 10))
    assert torch.equal(ya, yb) and (xa - xb).abs().mean() < 0.05                   # normalised units
    with pytest.raises(ConfigError, match="data.decode must be 'auto', 'pil', 'device' or 'hybrid', got 'gpu'"):
        cfg("gpu")


def test_device_decode_of_in_memory_images_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="data.decode must be 'auto' or 'pil' for dataset 'digits'"):
        D.prepare_data(DataConfig(dataset="digits", n_val=100, n_labeled=40, pipeline="loader", decode="device"), 0,
                       CPU)


# ---------------------------------------------------------------------------------------------
# data.decode hybrid: each batch split by position between the two paths
# ---------------------------------------------------------------------------------------------

FIELDS = ("x_sup", "y_sup", "x_unsup0", "x_unsup1")


def tree_config(tree, decode: str, fraction: float | None = None, workers: int = 0, size: int = 24) -> DataConfig:
    return DataConfig(dataset="imagefolder", root=str(tree), n_val=4, n_labeled=8, pipeline="loader", decode=decode,
                      workers=workers, image_size=size, colour_jitter=True, cpu_fraction=fraction)


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("twice", [False, True])
def test_a_hybrid_batchs_rows_are_the_pil_paths_and_the_device_paths_rows(jpeg_tree, fraction, twice):
    """Host rows are LoaderData's batch at those rows, device rows DecodedData's, labels both's: f = 1 is the PIL
    path's batch, f = 0 the device path's, bit for bit; 3 steps, so the pattern repeats each step."""
    pil, dev = (D.prepare_data(tree_config(jpeg_tree, decode), 0, CPU) for decode in ("pil", "device"))
    hybrid = D.prepare_data(tree_config(jpeg_tree, "hybrid", fraction), 0, CPU)
    assert type(hybrid) is D.HybridData
    host = torch.from_numpy(D.host_rows(0, 8, fraction))
    assert int(host.sum()) == round(8 * fraction + 1e-9)
    batches = zip(*(d.train_batches(1, 3, 8, 3, twice) for d in (pil, dev, hybrid)))
    for step, (a, b, h) in enumerate(batches):
        for name in FIELDS:
            ours = getattr(h, name)
            assert ours.shape == getattr(a, name).shape and ours.dtype == getattr(a, name).dtype, name
            assert torch.equal(ours[host], getattr(a, name)[host]), (step, name)
            assert torch.equal(ours[~host], getattr(b, name)[~host]), (step, name)
        assert (h.x_unsup1 is h.x_unsup0) == (not twice)
    assert step == 2 and hybrid.used == (fraction, int(host.sum()), 8)
    assert f"hybrid: PIL in 0 workers for {fraction:g} of each batch, the rest decoded on cpu (libjpeg" in \
        hybrid.describe()


def test_the_split_takes_round_of_batch_times_fraction_rows_spread_so_each_slice_gets_its_share():
    for batch in (1, 7, 16, 128, 1024):
        for f in (0.0, 0.05, 0.3, 0.5, 0.7, 0.75, 0.9, 1.0):
            whole = D.host_rows(0, batch, f)
            assert whole.sum() == np.floor(batch * f + 0.5), (batch, f)
            for world in (w for w in (2, 4, 8) if batch % w == 0):   # a data-parallel worker's slice: its share
                b = batch // world
                parts = [D.host_rows(r * b, b, f) for r in range(world)]
                assert np.array_equal(np.concatenate(parts), whole)
                assert all(abs(p.sum() - b * f) <= 1 for p in parts), (batch, f, world)
    assert D.host_rows(0, 10, 0.7).astype(int).tolist() == [1, 0, 1, 1, 1, 0, 1, 1, 0, 1]


@pytest.mark.parametrize("twice", [False, True])
def test_a_hybrid_worker_slice_is_its_part_of_the_one_process_batch(jpeg_tree, twice):
    """Also where a slice falls wholly on one side (f 0.25 over 4 slices of 2 rows: host, device, host, device)."""
    for fraction in (0.25, 0.6):
        data = D.prepare_data(tree_config(jpeg_tree, "hybrid", fraction), 0, CPU)
        whole = list(data.train_batches(2, 5, 8, 2, twice))
        for world in (2, 4):
            slices = [list(data.train_batches(2, 5, 8, 2, twice, shard=(r, world))) for r in range(world)]
            for step, batch in enumerate(whole):
                for name in FIELDS:
                    parts = [getattr(s[step], name) for s in slices]
                    assert torch.equal(torch.cat(parts), getattr(batch, name)), (fraction, world, step, name)


def test_hybrid_batches_do_not_depend_on_the_number_of_workers_or_on_timing(jpeg_tree):
    """Two DataLoader worker processes decoding the host rows, against the training process alone: the same
    batches, each time they are asked for."""
    alone = D.prepare_data(tree_config(jpeg_tree, "hybrid", 0.5), 0, CPU)
    workers = D.prepare_data(tree_config(jpeg_tree, "hybrid", 0.5, workers=2), 0, CPU)
    first = list(alone.train_batches(0, 7, 8, 3, True))
    for data in (workers, workers, alone):
        for a, b in zip(first, data.train_batches(0, 7, 8, 3, True)):
            assert all(torch.equal(getattr(a, name), getattr(b, name)) for name in FIELDS)
    assert "PIL in 2 workers" in workers.describe()


def test_hybrid_host_rows_and_device_rows_have_the_same_pixel_statistics(tmp_path):
    """The two halves of one hybrid batch (f 0.5) over 12 steps of 32: 192 rows each side, 2 views a row, are alike
    by the train views' tolerance: they are the two paths' augmentations, so a batch mixes no two distributions.
    Every file is the same photo: the two sides draw other files, and only the augmentation may differ between them."""
    photo = jpeg(scene(250, 188, 1))
    for i in range(12):
        folder = tmp_path / "train" / f"n{i % 4:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i}.JPEG").write_bytes(photo)
    data = D.prepare_data(tree_config(tmp_path, "hybrid", 0.5, size=48), 0, CPU)
    host = torch.from_numpy(D.host_rows(0, 32, 0.5))
    mean, std = torch.tensor(data.mean).view(1, 3, 1, 1), torch.tensor(data.std).view(1, 3, 1, 1)
    levels = lambda x: ((x * std + mean) * 255).round().double()                 # back to the uint8 values
    views = [(levels(b.x_sup), levels(b.x_unsup0)) for b in data.train_batches(0, 1, 32, 12, False)]
    pil = torch.cat([v[host] for pair in views for v in pair])
    ours = torch.cat([v[~host] for pair in views for v in pair])
    n = len(pil)
    assert n == len(ours) == 384
    for c in range(3):
        a, b = pil[:, c].mean((1, 2)), ours[:, c].mean((1, 2))
        se = (a.var() / n + b.var() / n).sqrt()
        assert abs(a.mean() - b.mean()) < 4 * se + 0.5, (c, a.mean(), b.mean(), se)
        assert abs(pil[:, c].std() / ours[:, c].std() - 1) < 0.05, c


def test_decode_auto_takes_the_stated_rule_and_hybrid_without_a_fraction_does_too(jpeg_tree):
    assert [D.auto_cpu_fraction(b, w) for b, w in ((128, 16), (64, 16), (16, 16), (63, 16))] == [0.8, 0.8, 1.0, 1.0]
    assert [D.auto_cpu_fraction(128, w) for w in (0, 8, 32)] == [0.0, 0.4, 1.0]
    assert D.auto_cpu_fraction(16, 4) == 0.25
    data = D.prepare_data(tree_config(jpeg_tree, "hybrid", workers=4), 0, CPU)   # None: the rule, 4 workers
    assert "data.decode hybrid's rule: 0.2 of batches of 64 or more a worker, 0.25 of smaller ones" in data.describe()
    list(data.train_batches(0, 0, 8, 1, False))
    assert data.used == (0.25, 2, 8) and "0.25 of each batch (data.decode hybrid's rule at 8 a worker)" in \
        data.describe()


def test_a_cpu_fraction_is_refused_outside_zero_to_one_and_without_decode_hybrid():
    with pytest.raises(ConfigError, match=r"data.cpu_fraction must be in \[0, 1\] or null, got 1.2"):
        DataConfig(decode="hybrid", cpu_fraction=1.2)
    with pytest.raises(ConfigError, match=r"data.cpu_fraction must be null unless data.decode is 'hybrid' "
                                          r"\(data.decode is 'auto'\), got 0.5"):
        DataConfig(cpu_fraction=0.5)
    assert DataConfig(decode="hybrid", cpu_fraction=0).cpu_fraction == 0
