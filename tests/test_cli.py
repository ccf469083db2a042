"""The `cowtune` command as a user runs it."""
import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

COWTUNE = [sys.executable, "-m", "trainables.cli"]


def run(*args, cwd=None):
    return subprocess.run([*COWTUNE, *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_masks_gallery_and_npy(tmp_path):
    r = run("masks", "--sigma", "4:16", "--p", "0.3:0.3", "-n", "12", "--size", "32", "--seed", "3",
            "--out", str(tmp_path / "g.png"), "--npy", str(tmp_path / "m.npy"))
    assert r.returncode == 0, r.stderr
    masks = np.load(tmp_path / "m.npy")
    assert masks.shape == (12, 32, 32) and set(np.unique(masks)) <= {0, 1}
    assert abs(masks.mean() - 0.3) < 0.06
    assert Image.open(tmp_path / "g.png").size[0] > 32 * 3
    again = run("masks", "--p", "0.3:0.3", "-n", "12", "--seed", "3", "--out", str(tmp_path / "g2.png"),
                "--npy", str(tmp_path / "m2.npy"))
    assert again.returncode == 0 and np.array_equal(masks, np.load(tmp_path / "m2.npy"))
    box = run("masks", "--kind", "box", "-n", "4", "--size", "16", "--out", str(tmp_path / "b.png"),
              "--npy", str(tmp_path / "b.npy"))
    assert box.returncode == 0 and np.load(tmp_path / "b.npy").shape == (4, 16, 16)


@pytest.mark.parametrize("args, message", [
    (["--p", "0.9:0.1"], "cowtune: error: --p must satisfy 0.0 <= low <= high <= 1.0, got (0.9, 0.1)"),
    (["--sigma", "16:4"], "cowtune: error: --sigma must satisfy 0.001 <= low <= high, got (16.0, 4.0)"),
    (["--kind", "box", "--box-scale", "2"], "cowtune: error: --box-scale must be in [0, 1], got 2.0"),
])
def test_masks_bad_option_is_one_clear_error_naming_the_option(tmp_path, args, message):
    r = run("masks", *args, "--out", str(tmp_path / "g.png"))
    assert r.returncode == 2
    assert r.stderr.strip() == message and "Traceback" not in r.stderr
    assert not (tmp_path / "g.png").exists()


def test_a_file_that_is_not_a_zip_is_named_as_such(tmp_path):
    bad = tmp_path / "train.zip"
    bad.write_text("not a zip")
    r = run("train", "fast", "--set", f"data.root={bad}", "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and "(a file that is not a zip archive)" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


def test_train_runs_resumes_and_rejects_bad_input(tmp_path):
    args = ["train", "fast", "--out", str(tmp_path / "run"), "--set", "data.dataset=digits",
            "--set", "data.n_val=300", "--set", "data.n_labeled=20", "--set", "train.epochs=2",
            "--set", "train.steps_per_epoch=3", "--set", "train.batch_size=16", "--set", "train.device=cpu"]
    r = run(*args)
    assert r.returncode == 0, r.stderr
    assert "epoch 2/2" in r.stdout and "ETA" in r.stdout
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["method"] == "cowmix" and set(result["split_hashes"]) >= {"val", "labeled", "unlabeled"}
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    # a longer run of another config in the same folder is refused, nothing is overwritten
    bad = run(*args, "--set", "mix.weight=3")
    assert bad.returncode == 2 and "differs in: mix.weight" in bad.stderr
    typo = run("train", "fast", "--set", "train.epoch=2")
    assert typo.returncode == 2 and "Did you mean 'epochs'" in typo.stderr and "Traceback" not in typo.stderr
    too_many = run(*args[:-2], "--out", str(tmp_path / "x"), "--set", "data.n_labeled=5000")
    assert too_many.returncode == 2 and "data.n_labeled" in too_many.stderr
    assert not (tmp_path / "x" / "checkpoint.pt").exists()
    misspelt = run(*args, "--set", "model=wrn28_3")      # in the trained run's folder: named, not "differs in"
    assert misspelt.returncode == 2 and "Unknown model 'wrn28_3'" in misspelt.stderr
    dry = run("train", "fast", "--dry-run", "--set", "data.dataset=cifar11")
    assert dry.returncode == 2 and "Unknown dataset 'cifar11'" in dry.stderr and "Traceback" not in dry.stderr


def test_final_checks_its_datasets_before_ray_starts(tmp_path):
    (tmp_path / "promoted.yaml").write_text("model: cnn_tiny\nmix: {name: cowmix}\n")
    r = run("final", "--config", str(tmp_path / "promoted.yaml"), "--datasets", f"cifar10={tmp_path / 'nowhere'}",
            "--seeds", "1", "--storage", str(tmp_path / "ray"), cwd=tmp_path)
    assert r.returncode == 2 and "data.root" in r.stderr and "nowhere" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "ray").exists()   # no Ray, no MLflow experiment
    assert not (tmp_path / "mlflow.db").exists()


def test_list_shows_registries():
    r = run("list")
    assert r.returncode == 0
    for name in ("cowmix", "cowout", "wrn26_6_shakeshake", "wrn28_2", "digits", "cifar10", "fast"):
        assert name in r.stdout
