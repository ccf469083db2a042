import dataclasses

import pytest
import torch

from trainables.config import OptimConfig, TrainConfig
from trainables.optim import lr_factor, make_optimizer
from trainables.presets import apply_overrides, list_presets, load_config, parse_value, read_config_file
from trainables.validation import ConfigError


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_builds_and_round_trips(name):
    cfg = load_config(name)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_paper_presets_match_the_paper():
    mix = load_config("cifar10_cowmix")
    assert mix.model == "wrn26_6_shakeshake" and mix.method == "cowmix"
    assert mix.mix.regularizer.sigma_range == (4.0, 16.0) and mix.mix.regularizer.prop_range == (0.2, 0.8)
    assert (mix.mix.weight, mix.mix.conf_thresh, mix.mix.conf_avg, mix.teacher.alpha) == (30.0, 0.6, True, 0.97)
    assert mix.data.n_labeled == 1000 and mix.train.batch_size == 256 and mix.train.epochs == 300
    out = load_config("cifar10_cowout")
    assert out.method == "cowout" and out.perturb.regularizer.prop_range == (0.25, 1.0)
    assert (out.perturb.weight, out.perturb.conf_thresh, out.perturb.conf_avg, out.teacher.alpha) == (1.0, 0.97, False, 0.99)


def test_overrides_and_ranges():
    cfg = load_config("cifar10_cowmix", ["mix.sigma_range=2:8", "train.epochs=3", "optim.schedule=cosine",
                                        "perturb.name=cowout", "data.labeled_seed=7"])
    assert cfg.mix.regularizer.sigma_range == (2.0, 8.0)
    assert cfg.train.epochs == 3 and cfg.optim.schedule == "cosine"
    assert cfg.method == "cowout+cowmix" and cfg.labeled_seed == 7
    assert parse_value("4:16") == [4.0, 16.0] and parse_value("null") is None and parse_value("1e-3") == 0.001
    assert load_config("cifar10_cowmix", ["mix=null"]).method == "supervised"


@pytest.mark.parametrize("overrides, message", [
    (["train.epcohs=3"], r"Unknown key in train 'epcohs'.*Did you mean 'epochs'"),
    (["modle=wrn28_2"], r"Did you mean 'model'"),
    (["mix.name=cowmx"], r"Unknown regularizer in mix.name 'cowmx'.*Did you mean 'cowmix'"),
    (["mix.sigma_range=16:4"], r"mix.sigma_range must satisfy"),
    (["teacher.alpha=1.2"], r"teacher.alpha must be in \[0, 1\], got 1.2"),
    (["train.epochs=ten"], r"train.epochs must be an integer, got 'ten'"),
    (["train.batch_size=1"], r"train.batch_size must be >= 2, got 1"),
    (["data.n_labeled=0"], r"data.n_labeled must be >= 1 or -1"),
    (["mix.conf_mode=prob"], r"mix.conf_mode must be 'mix_conf' or 'mix_prob'"),
    (["perturb.name=cowmix"], r"perturb.name must name an erasure regularizer, got 'cowmix'"),
    (["data.n_val=0", "data.eval_split=val"], r"data.eval_split must be 'test' when data.n_val is 0"),
    (["optim.steps=[[240, 0.04], [120, 0.2]]"], r"optim.steps must be sorted by epoch"),
    (["train.epochs"], r"--set takes key=value"),
    (["train.fast.conv_kernels=cutlass"], r"train.fast.conv_kernels must be 'cudnn' or 'triton', got 'cutlass'"),
    (["train.conv_kernels=cutlass"], r"train.fast.conv_kernels must be 'cudnn' or 'triton', got 'cutlass'"),
    (["train.fast.enabld=false"], r"Unknown key in train.fast 'enabld'.*Did you mean 'enabled'"),
    (["train.fast=maybe"], r"train.fast must be true, false or a mapping of its settings, got 'maybe'"),
    (["train.fast=false", "train.fast.cuda_graph=step", "train.fast.compile=true"],
     r"train.fast.compile must be false or left out: train.fast.enabled is false"),
])
def test_bad_config_names_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("cifar10_cowmix", overrides)


def test_unknown_preset_and_missing_file():
    with pytest.raises(ConfigError, match="Did you mean 'cifar10_cowmix'"):
        read_config_file("cifar10_cowmx")
    with pytest.raises(ConfigError, match="does not exist"):
        read_config_file("nope/config.yaml")


def test_train_fast_is_one_section_its_shorthand_and_the_layout_before_it():
    """The speed settings are one section, ``train.fast``: ``--set train.fast=false`` (or ``fast: false`` in a file)
    is ``train.fast.enabled=false`` in any order beside other ``train.fast`` settings; the layout before 2026-12-03
    (``train.compile`` beside ``train.fast: false``, as old checkpoints and searches' stores hold it) reads as the
    nested one, and a config is written back in the nested one only."""
    from trainables.config import FLAT_FAST_KEYS, FastSettings, TrainSettings

    assert {f.name for f in dataclasses.fields(FastSettings)} == {"enabled", *FLAT_FAST_KEYS}
    assert not {f.name for f in dataclasses.fields(TrainSettings)} & set(FLAT_FAST_KEYS)
    off = load_config("fast", ["train.fast=false"])
    assert off.train.fast.enabled is False and off.train.fast.compile is False
    assert load_config("fast", ["train.fast.enabled=false"]) == off
    both = load_config("fast", ["train.fast.gpu_turns=false", "train.fast=false"])
    assert both == load_config("fast", ["train.fast=false", "train.fast.gpu_turns=false"]) != off
    assert both.train.fast.gpu_turns is False
    assert TrainConfig.from_dict({"train": {"fast": True}}) == TrainConfig()
    spelled = {"precision": "fp32", "compile": True, "cuda_graph": "model", "tune_kernels": False, "gpu_turns": False}
    nested = TrainConfig.from_dict({"train": {"epochs": 3, "fast": spelled}})
    assert TrainConfig.from_dict({"train": {"epochs": 3, **spelled}}) == nested   # the layout before 2026-12-03
    assert TrainConfig.from_dict({"train": {"fast": False, "compile": False}}) == TrainConfig.from_dict(
        {"train": {"fast": False}})
    written = load_config("fast").to_dict()   # a config written in full (a run's config.json, a search's base)
    assert TrainConfig.from_dict(apply_overrides(written, ["train.compile=true"])).train.fast.compile is True
    with pytest.raises(ConfigError, match="train.compile and train.fast.compile are both given: train.compile is "
                                          "the layout before 2026-12-03, give train.fast.compile alone"):
        TrainConfig.from_dict({"train": {"compile": True, "fast": {"compile": False}}})   # a file with both
    train = nested.to_dict()["train"]
    assert not set(train) & set(FLAT_FAST_KEYS) and train["fast"]["compile"] is True
    assert TrainConfig.from_dict(nested.to_dict()) == nested and TrainConfig.from_dict(off.to_dict()) == off
    with pytest.raises(ConfigError, match="train.fast.compile must be false when train.fast.enabled is false"):
        FastSettings(enabled=False)   # a constructor call gets no plain values: FastSettings.from_plain gives them
    assert FastSettings.from_plain(False) == off.train.fast


def test_set_creates_nested_mapping():
    d = apply_overrides({}, ["mix.name=ict", "mix.alpha=0.5"])
    assert d == {"mix": {"name": "ict", "alpha": 0.5}}


def test_stepped_schedule_matches_reference_boundaries():
    cfg = OptimConfig()
    spe = 195
    assert lr_factor(0, spe, cfg) == 1.0
    assert lr_factor(23400, spe, cfg) == 1.0          # boundary 120 * 195 takes effect at +1
    assert lr_factor(23401, spe, cfg) == 0.2
    assert lr_factor(46801, spe, cfg) == pytest.approx(0.04)   # absolute factor, not cumulative
    cos = OptimConfig(schedule="cosine", cosine_half_epochs=10, warmup_epochs=1)
    assert lr_factor(0, 10, cos) == 0.0
    assert lr_factor(5, 10, cos) == pytest.approx(0.5 * (0.5 + 0.5 * torch.cos(torch.tensor(torch.pi * 5 / 100)).item()))
    assert lr_factor(100, 10, cos) == pytest.approx(0.0, abs=1e-12)


def test_l2_only_on_conv_and_linear_weights():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.LazyLinear(2))
    model(torch.zeros(1, 3, 5, 5))
    opt = make_optimizer(model, OptimConfig(lr_per_256=0.1), batch_size=512)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 5e-4 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model[0].weight), id(model[3].weight)}
    assert len(no_decay["params"]) == 4                 # conv bias, BN weight and bias, linear bias
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2) and opt.defaults["nesterov"]


def test_step_schedule_anneals_teacher_with_the_lr_shape():
    from trainables.optim import step_schedule
    cfg = TrainConfig.from_dict({"teacher": {"alpha": 0.97, "anneal": True}, "optim": {"warmup_epochs": 1}})
    lr, alpha = step_schedule(cfg, 23401, 195, base_lr=0.05)     # after epoch 120: factor 0.2
    assert lr == pytest.approx(0.01) and alpha == pytest.approx(1 - 0.03 * 0.2)
    lr0, alpha0 = step_schedule(cfg, 0, 195, base_lr=0.05)       # warm-up scales lr, not the teacher
    assert lr0 == 0.0 and alpha0 == pytest.approx(0.97)
    plain = TrainConfig.from_dict({"teacher": {"alpha": 0.97}})
    assert step_schedule(plain, 23401, 195, 0.05)[1] == 0.97
