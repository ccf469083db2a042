"""``benchmarks/large_image_learning.py`` on CPU in its smoke mode, on real JPEG files: a zip in CIFAR-10's layout
(10 classes of 32 px JPEGs, as ``.devdata/train.zip``) made into ImageNet's layout at a larger size, the holdout the
small-image path picks on the same zip, and both runs through the ``imagenet_cowmix`` preset recorded epoch by epoch
(no accuracy assertions: two epochs of a tiny model learn nothing that matters; the numbers are an H200's)."""
import io
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "large_image_learning.py"
sys.path.insert(0, str(ROOT))
import benchmarks.large_image_learning as lil   # noqa: E402

CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
PER_CLASS = 12   # the smoke mode's images a class: the whole zip below


def cifar_like_zip(path: Path) -> Path:
    """train/<class>/NNNN.jpg, 32x32 JPEGs at quality 75 of smooth random colours, CIFAR-10's class names."""
    rng = np.random.default_rng(0)
    with zipfile.ZipFile(path, "w") as z:
        for c in CLASSES:
            for i in range(PER_CLASS):
                buf = io.BytesIO()
                coarse = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
                Image.fromarray(coarse).resize((32, 32), Image.BICUBIC).save(buf, "JPEG", quality=75)
                z.writestr(f"train/{c}/{i:04d}.jpg", buf.getvalue())
    return path


def run(out: Path, data: Path, *extra: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out), "--data", str(data), *extra],
                       capture_output=True, text=True, timeout=300, cwd=out.parent)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    base = tmp_path_factory.mktemp("large_image")
    data = cifar_like_zip(base / "train.zip")
    out = base / "out"
    run(out, data)
    return out, data, json.loads((out / lil.JSON_NAME).read_text())


@pytest.mark.slow
def test_the_tree_is_imagenets_layout_at_the_new_size_with_the_small_image_holdout(smoke, tmp_path, monkeypatch):
    out, data, record = smoke
    tree = out / "smoke-tree"
    assert sorted(p.name for p in tree.iterdir()) == ["train", "tree.json", "val"]
    files = {split: sorted(p.relative_to(tree / split).as_posix() for p in (tree / split).rglob("*.jpg"))
             for split in ("train", "val")}
    assert (len(files["train"]), len(files["val"])) == (100, 20)
    for split in ("train", "val"):
        assert sorted(p.name for p in (tree / split).iterdir()) == CLASSES
    assert all(sum(f.startswith(f"{c}/") for f in files["val"]) == 2 for c in CLASSES)   # stratified: 2 a class
    with zipfile.ZipFile(data) as z:   # every image of the zip once, under its class and name
        assert sorted(files["train"] + files["val"]) == sorted(n.split("/", 1)[1] for n in z.namelist())
    for split, names in files.items():
        for f in names[:5]:
            with Image.open(tree / split / f) as img:
                assert (img.format, img.mode, img.size) == ("JPEG", "RGB", (48, 48))
    meta = json.loads((tree / "tree.json").read_text())
    assert record["tree"] == {**meta, "reused": False}
    assert (meta["side"], meta["quality"], meta["resample"], meta["files"]) == (48, 90, "bicubic",
                                                                               {"train": 100, "val": 20})

    # The holdout is the one the small-image path carves from the same zip (data.n_val 20 at data.val_seed 131)
    from trainables.config import DataConfig
    from trainables.data import load_raw, make_splits
    monkeypatch.setenv("COWTUNE_CACHE", str(tmp_path))
    cfg = DataConfig(dataset="imagefolder", root=str(data), n_val=20)
    raw = load_raw(cfg)
    assert raw.train_images.shape == (120, 32, 32, 3)   # decoded: the small-image path
    val = make_splits(raw.train_labels, cfg.n_val, cfg.val_seed, -1, 0).val
    with zipfile.ZipFile(data) as z:
        names = sorted(n.split("/", 1)[1] for n in z.namelist())   # the trainer's order
    assert sorted(names[i] for i in val) == files["val"]


@pytest.mark.slow
def test_both_runs_are_recorded_epoch_by_epoch_with_their_settings(smoke):
    out, _, record = smoke
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith("smoke-")) == [
        lil.JSON_NAME, lil.LOG_NAME, lil.PNG_NAME]
    assert (out / lil.PNG_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    m = record["machine"]
    assert m["gpu"] == "cpu" and m["torch"] and m["torchvision"] and m["commit"] and m["date"].endswith("UTC")
    s = record["settings"]
    assert (s["preset"], s["model"], s["side"], s["crop"], s["epochs"], s["batch"], s["n_labeled"]) == (
        "imagenet_cowmix", "cnn_tiny", 48, 32, 2, 8, 10)   # n_labeled: 10% of the 100 training images
    assert record["wall_s"] > 0 and list(record["runs"]) == ["supervised", "cowmix"]
    sup, mix = record["runs"]["supervised"], record["runs"]["cowmix"]
    for name, r in record["runs"].items():
        assert r["method"] == name and r["epochs_done"] == 2 and not r["stopped_by_budget"] and r["wall_s"] > 0
        c = r["curve"]
        assert c["epoch"] == [1, 2] and len(r["history"]) == 2
        for who in ("teacher", "student"):
            assert len(c[f"{who}_top1"]) == 2 and all(0 <= e <= 100 for e in c[f"{who}_top1"])
            assert c[f"{who}_top5"] == [None, None]   # the trainer reports top-5 above 10 classes only
        assert all(v > 0 for v in c["images_per_s"] + c["train_s"]) and len(c["lr"]) == 2
        assert r["sizes"] == {"train": 100, "val": 0, "labeled": 10, "unlabeled": 100, "test": 20}
        assert "loader pipeline (2 workers, PIL)" in r["pipeline"] and "inception crop 32" in r["pipeline"]
        assert "colour jitter" in r["pipeline"]
        assert r["command"].startswith("cowtune train imagenet_cowmix --out ")
        cfg = r["config"]
        assert (cfg["model"], cfg["data"]["image_size"], cfg["data"]["n_labeled"], cfg["train"]["epochs"]) == (
            "cnn_tiny", 32, 10, 2)
        assert cfg["data"]["eval_split"] == "test" and cfg["data"]["n_val"] == 0 and cfg["optim"]["lr_per_256"] == 0.04
    assert sup["split_hashes"] == mix["split_hashes"]   # the same labeled subset (and holdout) in both runs
    assert sup["config"]["mix"] is None and mix["config"]["mix"]["name"] == "cowmix"
    assert mix["config"]["mix"]["sigma_range"] == pytest.approx([32 * 32 / 224, 128 * 32 / 224], abs=1e-3)
    assert "train/loss_mix" in mix["history"][0] and "train/loss_mix" not in sup["history"][0]
    assert set(record["summary"]) == {"supervised", "cowmix", "cowmix_gain_points"}
    log = (out / lil.LOG_NAME).read_text()
    assert "--- supervised: cowtune train imagenet_cowmix" in log and "epoch 2/2" in log and "done in" in log


@pytest.mark.slow
def test_the_budget_stops_a_run_after_an_epoch_and_the_tree_is_reused(smoke, tmp_path):
    out, data, _ = smoke
    tree = out / "smoke-tree"
    assert lil.make_tree(data, tree, 48, 90, PER_CLASS, 20, 2)["reused"] is True   # the same settings: not made again
    args = lil.parse(["--smoke", "--out", str(tmp_path)])
    record, saved, lines = {}, [], []
    lil.run_one("supervised", lil.settings(args, tree, 10)["supervised"], tmp_path, time.monotonic(), record,
                lambda: saved.append(record["epochs_done"]), lines.append)   # a deadline already past
    assert record["stopped_by_budget"] and record["epochs_done"] == 1 and record["curve"]["epoch"] == [1]
    assert saved == [1, 1]   # after the epoch, and once more at the end
    assert "supervised: stopped after epoch 1 of 2: the next would end past the budget" in lines[-1]


@pytest.mark.slow
def test_a_run_that_fails_is_recorded_and_the_next_one_still_runs(smoke, tmp_path, capsys):
    out, data, _ = smoke
    rc = lil.main(["--smoke", "--out", str(tmp_path), "--data", str(data), "--tree", str(out / "smoke-tree"),
                   "--set", "model=resnet_51"])
    record = json.loads((tmp_path / lil.JSON_NAME).read_text())
    assert rc == 1 and list(record["runs"]) == ["supervised", "cowmix"]
    assert all("resnet_51" in r["error"] and "ConfigError" in r["error"] for r in record["runs"].values())
    assert "failed: supervised, cowmix (the JSON has the traceback)" in capsys.readouterr().out


def test_the_runs_are_the_preset_with_the_stated_changes(tmp_path):
    from trainables.presets import load_config

    args = lil.parse(["--out", str(tmp_path)])
    assert (args.side, args.crop, args.model, args.epochs, args.batch, args.decode) == (128, 128, "resnet50", 10, 128,
                                                                                        "auto")
    sets = lil.settings(args, tmp_path / "tree", 4500)
    preset = load_config("imagenet_cowmix")
    sup, mix = (load_config("imagenet_cowmix", sets[name]) for name in ("supervised", "cowmix"))
    assert sup.mix is None and sup.perturb is None and mix.method == "cowmix"
    for cfg in (sup, mix):
        assert (cfg.model, cfg.data.image_size, cfg.data.n_labeled, cfg.train.batch_size, cfg.train.epochs) == (
            "resnet50", 128, 4500, 128, 10)
        assert [x for step in cfg.optim.steps for x in step] == pytest.approx(
            [10 / 3, 0.2, 20 / 3, 0.04, 80 / 9, 0.008], abs=1e-3)   # the preset's at 1/3, 2/3 and 8/9 of the run
        assert (cfg.optim.lr_per_256, cfg.optim.l2, cfg.optim.nesterov) == (0.04, 0.00025, True)
        assert cfg.data.colour_jitter and cfg.data.pipeline == "loader" and cfg.data.decode == "auto"
        assert cfg.data.eval_split == "test" and cfg.data.n_val == 0 and cfg.teacher.alpha == 0.97
    assert mix.mix.regularizer.sigma_range == pytest.approx((32 * 128 / 224, 128 * 128 / 224), abs=1e-3)
    assert (mix.mix.weight, mix.mix.conf_thresh) == (30.0, 0.6)
    assert mix.mix.regularizer.prop_range == preset.mix.regularizer.prop_range
    assert lil.schedule(180) == "optim.steps=[[60, 0.2], [120, 0.04], [160, 0.008]]"   # the preset's own at 180
