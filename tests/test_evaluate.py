"""`cowtune evaluate` on a run trained for real on a tiny ImageFolder tree: it scores the images the run scored
and gets the run's own numbers, whatever the layout (folder, zip, train/ + test/), and refuses bad input in one line."""
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from trainables import metrics as M
from trainables.cli import main
from trainables.config import TrainConfig
from trainables.data import NORMALISATION
from trainables.evaluate import CIFAR10_CLASSES, CIFAR100_CLASSES, evaluate_checkpoint, legacy_record
from trainables.models import create_model
from trainables.trainer import fit
from trainables.validation import ConfigError

CLASSES = ["blue", "green", "red"]
SPREAD = 70
COLOURS = {"red": (200, 40, 40), "green": (40, 190, 60), "blue": (50, 60, 210)}


def _write_tree(root: Path, per_class: dict[str, int], size: int = 32, seed: int = 0) -> None:
    """<split>/<class>/<i>.png|jpg: a class colour, shifted per image so that classes overlap, plus pixel noise."""
    rng = np.random.default_rng(seed)
    for split, n in per_class.items():
        for c in CLASSES:
            (root / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                tint = np.array(COLOURS[c]) + rng.normal(0, SPREAD, 3)          # per image: classes overlap
                img = np.clip(tint + rng.normal(0, 40, (size, size, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(img).save(root / split / c / f"{i:03d}.{'jpg' if i % 2 else 'png'}")


def _zip(folder: Path, out: Path, prefix: str = "") -> Path:
    with zipfile.ZipFile(out, "w") as z:
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                z.write(p, prefix + p.relative_to(folder).as_posix())
    return out


def _config(root: Path, **data) -> TrainConfig:
    return TrainConfig.from_dict({
        "seed": 0, "model": "cnn_tiny",
        "data": {"dataset": "imagefolder", "root": str(root), "n_val": 6, "n_labeled": -1, "eval_split": "test",
                 **data},
        "optim": {"lr_per_256": 2.0, "schedule": "constant"},
        "train": {"batch_size": 16, "epochs": 2, "steps_per_epoch": 3, "eval_batch_size": 7, "device": "cpu"},
    })


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A supervised cnn_tiny run on train/ (3 x 24 images), evaluated by itself on test/ (3 x 8)."""
    tmp = tmp_path_factory.mktemp("evaluate")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COWTUNE_CACHE", str(tmp / "cache"))
        _write_tree(tmp / "tree", {"train": 24, "test": 8})
        result = fit(_config(tmp / "tree"), tmp / "run", log=lambda s: None)
        yield {"tmp": tmp, "tree": tmp / "tree", "run": tmp / "run", "final": result["final"]}


def _same_as_run(result, final):
    for name in ("teacher", "student"):
        assert result[name]["error"] == final[M.eval_key("test", "error", name)], name
        assert result[name]["loss"] == pytest.approx(final[M.eval_key("test", "loss", name)], rel=1e-6, abs=1e-7)


def test_checkpoint_records_its_data_and_loads_weights_only(run):
    ckpt = torch.load(run["run"] / "checkpoint.pt", weights_only=True)
    record = ckpt["data"]
    assert record["class_names"] == CLASSES and record["image_shape"] == [3, 32, 32] and record["pipeline"] == "device"
    train = np.stack([np.asarray(Image.open(p).convert("RGB")) for p in sorted((run["tree"] / "train").rglob("*.*"))])
    assert record["mean"] == pytest.approx((train / 255.0).mean((0, 1, 2)), abs=1e-9)
    assert record["std"] == pytest.approx((train / 255.0).std((0, 1, 2)), abs=1e-9)


def test_scores_test_split_of_folder_and_zip_as_the_run_did(run, tmp_path):
    tree, final = run["tree"], run["final"]
    for name in ("teacher", "student"):      # learnt something, not everything: the errors are worth comparing
        assert 0 < final[M.eval_key("test", "error", name)] < 2 / 3
    lines = []
    both = evaluate_checkpoint(str(run["run"]), str(tree), device="cpu", log=lines.append)
    assert both["images"] == 24 and both["scored"] == "test/ (not train/)" and both["epoch"] == 2
    _same_as_run(both, final)
    assert any("scored 24 images of" in s and "test/ (not train/)" in s for s in lines)
    layouts = {
        "zip of train/ + test/ in a wrapping folder": _zip(tree, tmp_path / "all.zip", prefix="mydata/"),
        "zip of test/ alone": _zip(tree / "test", tmp_path / "test.zip", prefix="test/"),
        "class folders": tree / "test",
        "zip of class folders": _zip(tree / "test", tmp_path / "classes.zip"),
    }
    for layout, path in layouts.items():
        r = evaluate_checkpoint(str(run["run"] / "checkpoint.pt"), str(path), batch_size=5, device="cpu",
                                log=lambda s: None)
        assert r["images"] == 24 and r["classes"] == 3, layout
        assert r["teacher"]["error"] == both["teacher"]["error"] and r["student"]["error"] == both["student"]["error"]
        assert r["teacher"]["loss"] == pytest.approx(both["teacher"]["loss"], rel=1e-6), layout
    assert evaluate_checkpoint(str(run["run"]), str(layouts["zip of train/ + test/ in a wrapping folder"]),
                               device="cpu", log=lambda s: None)["scored"] == "mydata/test/ (not train/)"
    assert evaluate_checkpoint(str(run["run"]), str(tree / "test"), device="cpu",
                               log=lambda s: None)["scored"] == "every class folder"


def test_matches_a_direct_forward_pass(run, tmp_path):
    """Independently of the pipeline: decode with PIL, normalise with numpy's statistics of the training images,
    forward each model in eval mode, count the mistakes."""
    train = np.stack([np.asarray(Image.open(p).convert("RGB")) for p in sorted((run["tree"] / "train").rglob("*.*"))])
    mean, std = (train / 255.0).mean((0, 1, 2)), (train / 255.0).std((0, 1, 2))
    for c in ("green", "red"):                   # a subset of the classes, labelled by the run's order all the same
        shutil.copytree(run["tree"] / "train" / c, tmp_path / "two" / c)
    files = sorted((tmp_path / "two").rglob("*.*"))
    x = np.stack([(np.asarray(Image.open(p).convert("RGB")) / 255.0 - mean) / std for p in files])
    x = torch.from_numpy(x).float().permute(0, 3, 1, 2)
    y = torch.tensor([CLASSES.index(p.parent.name) for p in files])
    got = evaluate_checkpoint(str(run["run"]), str(tmp_path / "two"), device="cpu", log=lambda s: None)
    assert got["images"] == 48 and got["classes"] == 2
    ckpt = torch.load(run["run"] / "checkpoint.pt", weights_only=True)
    for name in ("teacher", "student"):
        model = create_model("cnn_tiny", 3)
        model.load_state_dict(ckpt[name])
        with torch.no_grad():
            logits = model.eval()(x)
        assert got[name]["error"] == (logits.argmax(1) != y).sum().item() / len(y)
        assert got[name]["loss"] == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-5)


def test_cli_prints_and_writes_json(run, tmp_path, capsys):
    out = tmp_path / "scores.json"
    assert main(["evaluate", "--checkpoint", str(run["run"]), "--data", str(run["tree"]), "--device", "cpu",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["images"] == 24 and saved["epoch"] == 2 and saved["data"] == str(run["tree"])
    assert saved["class_names"] == CLASSES and saved["normalisation"]["source"] == "recorded in the checkpoint"
    _same_as_run(saved, run["final"])
    for name in ("teacher", "student"):
        assert f"{name}: error {100 * saved[name]['error']:.2f}%  cross-entropy {saved[name]['loss']:.4f}" in printed
    assert "epoch 2" in printed and f"scored 24 images of {run['tree']}: test/" in printed


def test_command_runs_as_a_user_runs_it(run):
    r = subprocess.run([sys.executable, "-m", "trainables.cli", "evaluate", "--checkpoint", str(run["run"]),
                        "--data", str(run["tree"] / "test"), "--device", "cpu"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"teacher: error {100 * run['final'][M.eval_key('test', 'error', 'teacher')]:.2f}%" in r.stdout


def _error(capsys, *args, json_file=None):
    argv = ["evaluate", *args, "--device", "cpu"] + (["--json", str(json_file)] if json_file else [])
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("cowtune: error: ") and err.count("\n") == 1, err
    return err


def test_each_bad_input_is_one_clear_line(run, tmp_path, capsys):
    ckpt, tree = str(run["run"]), str(run["tree"])
    (tmp_path / "empty").mkdir()
    assert "--checkpoint must name a checkpoint.pt or the run folder holding it, got 'nowhere/x.pt' (not found)" \
        in _error(capsys, "--checkpoint", "nowhere/x.pt", "--data", tree)
    assert f"got '{tmp_path / 'empty'}' (a folder without checkpoint.pt)" in \
        _error(capsys, "--checkpoint", str(tmp_path / "empty"), "--data", tree)
    (tmp_path / "notes.pt").write_text("not a checkpoint\n")
    assert "--checkpoint must be a checkpoint written by `cowtune train`" in \
        (e := _error(capsys, "--checkpoint", str(tmp_path / "notes.pt"), "--data", tree)) and "not a PyTorch file" in e
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    assert "(a PyTorch file without config, epoch, student, teacher)" in \
        _error(capsys, "--checkpoint", str(tmp_path / "other.pt"), "--data", tree)
    torch.save({"config": {}, "epoch": np.float64(1.0)}, tmp_path / "pickled.pt")   # needs more than weights_only
    assert "torch.load(weights_only=True) refuses: Unsupported global" in \
        _error(capsys, "--checkpoint", str(tmp_path / "pickled.pt"), "--data", tree)

    assert "--data must be a folder or .zip of class folders (or of train/ and test/), got 'no/such/dir' (not found)" \
        in _error(capsys, "--checkpoint", ckpt, "--data", "no/such/dir")
    assert "--data must hold image files (.jpg, .jpeg, .png" in _error(capsys, "--checkpoint", ckpt, "--data",
                                                                       str(tmp_path / "empty"))
    (tmp_path / "list.txt").write_text("cat/1.png\n")
    assert "got '" + str(tmp_path / "list.txt") + "' (neither a folder nor a .zip)" in \
        _error(capsys, "--checkpoint", ckpt, "--data", str(tmp_path / "list.txt"))
    assert "--json must be a file in an existing folder, got 'no/dir/r.json'" in \
        _error(capsys, "--checkpoint", ckpt, "--data", tree, json_file="no/dir/r.json")
    Image.new("RGB", (32, 32)).save(tmp_path / "empty" / "loose.png")
    assert "--data must hold images in class folders" in _error(capsys, "--checkpoint", ckpt, "--data",
                                                                str(tmp_path / "empty"))

    _write_tree(tmp_path / "mine", {"test": 2})
    (tmp_path / "mine" / "test" / "green").rename(tmp_path / "mine" / "test" / "gren")
    (tmp_path / "mine" / "test" / "blue").rename(tmp_path / "mine" / "test" / "purple")
    assert ("--data must hold class folders named as the model's classes (blue, green, red), "
            "got 'gren' (did you mean 'green'?), 'purple'") in \
        _error(capsys, "--checkpoint", ckpt, "--data", str(tmp_path / "mine"), json_file=tmp_path / "no.json")
    assert not (tmp_path / "no.json").exists()

    _write_tree(tmp_path / "small", {"test": 2}, size=24)
    assert "--data must hold images of the size the model was trained on (32x32), got blue/000.png of 24x24" in \
        _error(capsys, "--checkpoint", ckpt, "--data", str(tmp_path / "small" / "test"))
    _write_tree(tmp_path / "mixed", {"test": 2})
    Image.new("RGB", (32, 30)).save(tmp_path / "mixed" / "test" / "red" / "zzz.png")
    assert "--data must hold images of the size the model was trained on (32x32), got test/red/zzz.png of 32x30" in \
        _error(capsys, "--checkpoint", ckpt, "--data", str(tmp_path / "mixed"))
    assert "--batch-size must be >= 1, got 0" in _error(capsys, "--checkpoint", ckpt, "--data", tree,
                                                        "--batch-size", "0")


def test_older_checkpoint_without_data_entry(run, tmp_path, capsys, monkeypatch):
    """Written before checkpoints recorded their data: the statistics are recomputed from the run's data.root,
    or from --train-data when that is gone; without either, one message says what is missing."""
    monkeypatch.setenv("COWTUNE_CACHE", str(run["tmp"] / "cache"))
    ckpt = torch.load(run["run"] / "checkpoint.pt", weights_only=True)
    del ckpt["data"]
    (tmp_path / "old").mkdir()
    torch.save(ckpt, tmp_path / "old" / "checkpoint.pt")
    r = evaluate_checkpoint(str(tmp_path / "old"), str(run["tree"]), device="cpu", log=lambda s: None)
    _same_as_run(r, run["final"])
    assert r["normalisation"]["source"] == f"recomputed from the training images at {run['tree']}"

    ckpt["config"]["data"]["root"] = str(tmp_path / "moved")
    (tmp_path / "gone").mkdir()
    torch.save(ckpt, tmp_path / "gone" / "checkpoint.pt")
    err = _error(capsys, "--checkpoint", str(tmp_path / "gone"), "--data", str(run["tree"]))
    assert (f"--checkpoint predates recorded class names and normalisation, and the run's training images are not "
            f"at data.root '{tmp_path / 'moved'}' to recompute them from: pass --train-data PATH") in err
    assert main(["evaluate", "--checkpoint", str(tmp_path / "gone"), "--data", str(run["tree"]), "--device", "cpu",
                 "--train-data", str(run["tree"]), "--json", str(tmp_path / "r.json")]) == 0
    _same_as_run(json.loads((tmp_path / "r.json").read_text()), run["final"])


def test_older_torchvision_checkpoints_use_the_standard_constants():
    assert len(CIFAR100_CLASSES) == 100 and list(CIFAR100_CLASSES) == sorted(CIFAR100_CLASSES)
    for dataset, classes in (("cifar10", CIFAR10_CLASSES), ("cifar100", CIFAR100_CLASSES)):
        cfg = TrainConfig.from_dict({"data": {"dataset": dataset, "root": "/nonexistent"}})
        record, source = legacy_record(cfg, None)
        assert record["class_names"] == list(classes) and record["image_shape"] == [3, 32, 32]
        assert (tuple(record["mean"]), tuple(record["std"])) == NORMALISATION[dataset] and dataset in source
    svhn = legacy_record(TrainConfig.from_dict({"data": {"dataset": "svhn"}}), None)[0]
    assert svhn["class_names"] == [str(i) for i in range(10)] and svhn["pipeline"] == "device"


def test_loader_pipeline_run_is_scored_with_its_centre_crop(tmp_path, monkeypatch):
    """A run that read files through the loader pipeline (centre crop, resized to data.image_size): evaluated the
    same way, on images of any size."""
    monkeypatch.setenv("COWTUNE_CACHE", str(tmp_path / "cache"))
    _write_tree(tmp_path / "tree", {"train": 6, "test": 3}, size=40)
    cfg = TrainConfig.from_dict({**_config(tmp_path / "tree").to_dict(),
                                 "data": {**_config(tmp_path / "tree").to_dict()["data"], "pipeline": "loader",
                                          "image_size": 24, "workers": 0}})
    final = fit(TrainConfig.from_dict({**cfg.to_dict(), "train": {**cfg.to_dict()["train"], "epochs": 1}}),
                tmp_path / "run", log=lambda s: None)["final"]
    r = evaluate_checkpoint(str(tmp_path / "run"), str(tmp_path / "tree"), device="cpu", log=lambda s: None)
    assert r["images"] == 9
    _same_as_run(r, final)
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["data"]["pipeline"] == "loader"


def test_unknown_config_in_checkpoint_and_missing_device(run, tmp_path, capsys):
    ckpt = torch.load(run["run"] / "checkpoint.pt", weights_only=True)
    ckpt["config"]["train"]["epoch"] = 3
    torch.save(ckpt, tmp_path / "checkpoint.pt")
    assert "--checkpoint's config does not load in this version of cowtune: Unknown key in train 'epoch'" in \
        _error(capsys, "--checkpoint", str(tmp_path), "--data", str(run["tree"]))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"--device must name an available device, got 'cuda' \(no CUDA here\)"):
            evaluate_checkpoint(str(run["run"]), str(run["tree"]), device="cuda")
