"""``cowtune final --datasets imagenet=DIR``: the ``imagenet_cowmix`` preset with only what transfers from a promoted
small-image config (``trainables.search.final.transfer``, a pure function), the table saying where each field came
from, and the 10% labeled subset stratified per class as the reference's (StratifiedShuffleSplit with
test_size = n_sup, ``Generate_ImageNet_split_shards.ipynb``)."""
from __future__ import annotations

import numpy as np
import pytest

from imagenet_trees import jpeg_tree
from trainables.config import TrainConfig
from trainables.data import make_splits
from trainables.data.image_files import listed_labels
from trainables.presets import IMAGENET_PRESET, load_config
from trainables.search.final import final_configs, provenance, save_table, sigma_scale, ten_percent, transfer

# A searched small-image config: every field that a search could move, moved off the paper's value
PROMOTED = {"seed": 3, "model": "wrn28_2", "data": {"dataset": "cifar10", "n_val": 5000, "n_labeled": 1000},
            "optim": {"lr_per_256": 0.07, "l2": 1e-4, "steps": [[100, 0.3]]}, "teacher": {"alpha": 0.95},
            "mix": {"name": "cowmix", "sigma_range": [2.0, 12.0], "prop_range": [0.3, 0.7], "weight": 45.0,
                    "conf_thresh": 0.8, "conf_avg": False, "conf_mode": "mix_prob"},
            "train": {"batch_size": 64, "epochs": 60, "precision": "fp32", "bn_batch": 32}}


def full(d: dict) -> dict:
    return TrainConfig.from_dict(d).to_dict()


def test_only_what_the_paper_kept_at_both_scales_is_carried_and_sigma_is_scaled():
    preset = load_config(IMAGENET_PRESET).to_dict()
    config, sources = transfer(preset, full(PROMOTED))
    mix = config["mix"]
    # carried: the method and the mix path's rule (the paper used the same at 32 and at 224 px)
    assert (mix["name"], mix["prop_range"], mix["conf_avg"], mix["conf_mode"]) == ("cowmix", [0.3, 0.7], False, "mix_prob")
    assert {k: sources[f"mix.{k}"] for k in ("name", "prop_range", "conf_avg", "conf_mode", "mix_logits")} == \
        dict.fromkeys(("name", "prop_range", "conf_avg", "conf_mode", "mix_logits"), "promoted")
    # scaled: sigma is in pixels; 8x from 32 to 224 px, as the paper's (4, 16) -> (32, 128)
    assert mix["sigma_range"] == [16.0, 96.0] and sources["mix.sigma_range"].startswith("scaled x8")
    # the preset's: what the paper re-set for ImageNet (omega 30 -> 100, threshold 0.6 -> 0.5), and the rest
    assert (mix["weight"], mix["conf_thresh"]) == (100.0, 0.5) and sources["mix.weight"] == "preset"
    rest = {k: v for k, v in config.items() if k not in ("mix", "perturb")}
    assert rest == {k: v for k, v in preset.items() if k not in ("mix", "perturb")}   # model, batch, LR, schedule...
    assert not any(k.split(".")[0] in ("model", "optim", "train", "teacher", "data") for k in sources)
    assert config["perturb"] is None and sources["perturb"] == "promoted"
    assert sigma_scale(32, 224) == 8.0 and sigma_scale(32, 112) == 4.0 and sigma_scale(64, 224) == 4.0
    assert TrainConfig.from_dict(config).method == "cowmix"


def test_an_erasure_or_supervised_promoted_config_brings_its_own_paths():
    preset = load_config(IMAGENET_PRESET).to_dict()
    cowout = full({"perturb": {"name": "cowout", "sigma_range": [4.0, 16.0], "prop_range": [0.25, 1.0],
                               "conf_thresh": 0.9}, "mix": None, "teacher": {"alpha": 0.99}})
    config, sources = transfer(preset, cowout)
    assert config["mix"] is None and config["perturb"]["name"] == "cowout"
    assert config["perturb"]["sigma_range"] == [32.0, 128.0] and config["perturb"]["conf_thresh"] == 0.9
    assert sources["perturb.conf_thresh"] == "promoted" and config["teacher"]["alpha"] == 0.999   # the preset's
    assert TrainConfig.from_dict(config).method == "cowout"
    config, _ = transfer(preset, full({"mix": None, "perturb": None}))
    assert TrainConfig.from_dict(config).method == "supervised"


def test_a_set_may_name_a_path_only_the_promoted_config_has(tmp_path):
    tree = jpeg_tree(tmp_path / "imagenet", {f"n{c:08d}": 10 for c in range(4)}, val_per_class=1)
    cowout = {"perturb": {"name": "cowout"}, "mix": None}
    (run,) = final_configs(cowout, {"imagenet": str(tree)}, None, 1, False, ["perturb.weight=2"])
    assert run["config"]["perturb"]["weight"] == 2 and run["config"]["mix"] is None
    assert "| perturb.weight | 2 | --set |" in provenance(cowout, ["perturb.weight=2"])


def test_final_uses_the_preset_and_says_where_each_field_came_from(tmp_path):
    tree = jpeg_tree(tmp_path / "imagenet", {f"n{c:08d}": 12 + c for c in range(4)}, val_per_class=2)   # 54 train
    runs = final_configs(PROMOTED, {"imagenet": str(tree)}, None, 2, True, ["train.epochs=2"])
    assert [(r["method"], r["seed"]) for r in runs] == [("promoted", 0), ("promoted", 1), ("supervised", 0),
                                                        ("supervised", 1)]
    cfg = runs[0]["config"]
    assert cfg["model"] == "resnet152" and cfg["train"]["batch_size"] == 1024 and cfg["optim"]["lr_per_256"] == 0.04
    assert cfg["train"]["epochs"] == 2 and cfg["teacher"]["alpha"] == 0.999 and cfg["train"]["bn_batch"] is None
    assert cfg["data"]["n_labeled"] == 5 and cfg["data"]["root"] == str(tree) and cfg["data"]["eval_split"] == "test"
    assert cfg["mix"]["prop_range"] == [0.3, 0.7] and cfg["mix"]["sigma_range"] == [16.0, 96.0]
    assert runs[2]["config"]["mix"] is None and runs[2]["config"]["model"] == "resnet152"
    # a --set image size scales sigma from it: 112 px is 4x the 32 px of the search
    small = final_configs(PROMOTED, {"imagenet": str(tree)}, [8], 1, False, ["data.image_size=112"])[0]["config"]
    assert small["mix"]["sigma_range"] == [8.0, 48.0] and small["data"]["n_labeled"] == 8
    table = provenance(PROMOTED, ["train.epochs=2"])
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert "| 0.04 | preset (promoted: 0.07, not carried) |" in rows["optim.lr_per_256"]
    assert "| [0.3, 0.7] | promoted |" in rows["mix.prop_range"]
    assert "scaled x8 from the promoted [2.0, 12.0] (32 -> 224 px)" in rows["mix.sigma_range"]
    assert "| 0.5 | preset (promoted: 0.8, not carried) |" in rows["mix.conf_thresh"]
    assert "| 2 | --set |" in rows["train.epochs"] and '"resnet152" | preset' in rows["model"]
    path, saved = save_table(tmp_path / "out", [{"dataset": "imagenet", "labels": -10, "method": "promoted", "seed": 0,
                                                 "error": 0.3}], "cowmix", table)
    assert "| imagenet | 10% | 30.00 ± 0.00 (n=1) |" in saved and "| optim.lr_per_256 |" in path.read_text()
    _, top5 = save_table(tmp_path / "out5", [{"dataset": "imagenet", "labels": -10, "method": "promoted", "seed": s,
                                              "error": e, "error5": e5} for s, e, e5 in ((0, 0.3, 0.1), (1, 0.32, 0.12))],
                         "cowmix")
    assert "| imagenet | 10% | 31.00 ± 1.41 (n=2) | - | 26.06 ± 0.17 | 42.91 |" in top5
    assert "| ours: cowmix (top-5) |" in top5 and "| imagenet | 10% | 11.00 ± 1.41 (n=2) | - | 8.76 ± 0.07 | 22.12 |" in top5


def test_the_ten_percent_subset_is_the_references_stratified_rule_on_a_tree(tmp_path):
    """Each class gets its share (10% of its images, rounded down or up), the total is the floor of 10%, the
    picks are sklearn's StratifiedShuffleSplit(test_size=n) test indices as the reference's notebook draws them,
    each seed another subset, and the unlabeled pool every training image."""
    from sklearn.model_selection import StratifiedShuffleSplit

    sizes = {"n01440764": 31, "n01443537": 47, "n01484850": 59, "n01491361": 73, "n01494475": 90}   # 300 images
    tree = jpeg_tree(tmp_path / "imagenet", sizes, val_per_class=1, size=(16, 12))
    labels = listed_labels(str(tree), "tree")
    (run,) = final_configs(PROMOTED, {"imagenet": str(tree)}, None, 1, False, [])
    n = run["config"]["data"]["n_labeled"]
    assert n == ten_percent(len(labels)) == 30 and ten_percent(1281167) == 128116 and ten_percent(1231167) == 123116
    picked = []
    for seed in range(3):
        s = make_splits(labels, 0, 131, n, seed)
        counts = np.bincount(labels[s.labeled], minlength=len(sizes))
        share = np.bincount(labels) / 10
        assert len(s.labeled) == n and ((counts == np.floor(share)) | (counts == np.ceil(share))).all(), counts
        _, expected = next(StratifiedShuffleSplit(n_splits=1, test_size=n, random_state=seed).split(labels, labels))
        assert np.array_equal(s.labeled, np.sort(expected)) and np.array_equal(s.unlabeled, np.arange(len(labels)))
        picked.append(set(s.labeled.tolist()))
    assert len({frozenset(p) for p in picked}) == 3


def test_skipping_the_data_check_needs_explicit_labels(tmp_path):
    nowhere = str(tmp_path / "nowhere")
    with pytest.raises(Exception, match="--labels"):
        final_configs(PROMOTED, {"imagenet": nowhere}, None, 1, False, [], check_data=False)
    (run,) = final_configs(PROMOTED, {"imagenet": nowhere}, [128116], 1, False, [], check_data=False)
    assert run["config"]["data"]["n_labeled"] == 128116 and run["config"]["model"] == "resnet152"
