"""Checkpoints of the shake-shake WRN written before its convolutions feeding a batch norm lost their bias
(``trainables.legacy_checkpoints``): the optimiser's state maps onto the new layout, and a run stopped in the
old layout resumes in the new one. Checkpoints whose config has the speed settings directly under ``train`` (the
layout before 2026-12-03, ``trainables.config.upgrade_layout``) resume as well."""
from __future__ import annotations

import copy

import pytest
import torch

from trainables import checkpoints
from trainables.config import OptimConfig, TrainConfig
from trainables.data import prepare_data
from trainables.legacy_checkpoints import upgrade_optimizer_state
from trainables.models import MODELS, create_model
from trainables.models.segmented_bn import convert_batch_norm
from trainables.optim import make_optimizer
from trainables.trainer import fit


@pytest.fixture
def old_layout():
    """Within: shake-shake models built in the reference's layout (biased convolutions before batch norm)."""
    def build(name="wrn26_2_shakeshake"):
        return convert_batch_norm(MODELS[name](10, bn_conv_bias=True))
    return build


def _step(model, optimizer, x, y):
    optimizer.zero_grad()
    torch.manual_seed(3)   # the shake-shake gates
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def test_upgraded_optimizer_continues_the_old_run(old_layout):
    """Two SGD steps in the old layout, then one more there and one in the new layout from the upgraded state:
    the same parameters (float64), so each momentum buffer went to its own parameter."""
    torch.manual_seed(0)
    old = old_layout().double().train()
    cfg = OptimConfig(lr_per_256=0.5)
    opt_old = make_optimizer(old, cfg, 256)
    x, y = torch.randn(4, 3, 32, 32, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    for _ in range(2):
        _step(old, opt_old, x, y)
    # copies, as a checkpoint holds them (a live optimiser's state dict shares its momentum buffers)
    model_state, opt_state = copy.deepcopy(old.state_dict()), copy.deepcopy(opt_old.state_dict())
    new = create_model("wrn26_2_shakeshake", 10).double().train()
    new.load_state_dict(model_state)
    opt_new = make_optimizer(new, cfg, 256)
    with pytest.raises(ValueError, match="doesn't match the size"):
        opt_new.load_state_dict(opt_state)   # what a resume met before the upgrade
    upgraded = upgrade_optimizer_state(opt_state, model_state, new)
    assert [len(g["params"]) for g in upgraded["param_groups"]] == [len(g["params"]) for g in opt_new.param_groups]
    opt_new.load_state_dict(upgraded)
    _step(old, opt_old, x, y)
    _step(new, opt_new, x, y)
    after_old = dict(old.named_parameters())
    for name, p in new.named_parameters():
        torch.testing.assert_close(p, after_old[name], rtol=1e-9, atol=1e-12, msg=name)
    assert upgrade_optimizer_state(opt_new.state_dict(), new.state_dict(), new) == opt_new.state_dict()
    shuffled = dict(reversed(list(model_state.items())))   # names no longer in the optimiser's order
    with pytest.raises(ValueError, match="does not follow its model state's parameter order"):
        upgrade_optimizer_state(opt_state, shuffled, new)


def test_a_run_stopped_in_the_old_layout_resumes_in_the_new(tmp_path, old_layout, monkeypatch):
    """fit() in the old layout, stopped after epoch 1, resumed by today's model: it finishes, and ends where a
    straight run in the old layout ends (float32 CPU: to rounding)."""
    cfg = TrainConfig.from_dict({
        "seed": 0, "model": "wrn26_2_shakeshake", "mix": {"name": "cowmix"},
        "data": {"dataset": "digits", "n_val": 200, "n_labeled": 30},
        "optim": {"lr_per_256": 0.5, "schedule": "constant"},
        "train": {"batch_size": 4, "epochs": 2, "steps_per_epoch": 2, "eval_batch_size": 256, "device": "cpu"}})
    data = prepare_data(cfg.data, 0, torch.device("cpu"))

    def die(epoch, metrics, path):
        raise KeyboardInterrupt

    with monkeypatch.context() as old:   # fit builds the old layout
        builder = MODELS["wrn26_2_shakeshake"]
        old.setitem(MODELS, "wrn26_2_shakeshake", lambda n: builder(n, bn_conv_bias=True))
        fit(cfg, tmp_path / "straight", data=data, log=lambda s: None)
        with pytest.raises(KeyboardInterrupt):
            fit(cfg, tmp_path / "b", data=data, report=die, log=lambda s: None)
    saved = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)
    assert "blocks.0.branch_a.1.bias" in saved["student"] and saved["epoch"] == 1
    fit(cfg, tmp_path / "b", data=data, log=lambda s: None)   # resumes: today's layout
    a = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=False)["student"]
    b = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)
    assert b["epoch"] == 2 and "blocks.0.branch_a.1.bias" not in b["student"]
    reference = old_layout()
    reference.load_state_dict(a)
    folded = create_model("wrn26_2_shakeshake", 10)
    folded.load_state_dict(reference.state_dict())   # the straight run's biases folded as the resume folded them
    # to rounding: the folded biases change float32's order of operations, and four steps at LR 0.5 on 4 images
    # carry that to 2e-5 on weights of 0.1-0.4 with one CPU thread (7e-7 with two); a bias dropped instead of
    # folded moves its batch norm's running mean by up to 2e-3
    for k, v in folded.state_dict().items():
        torch.testing.assert_close(b["student"][k], v, rtol=1e-4, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


def flat_layout(config: dict) -> dict:
    """``config`` (``TrainConfig.to_dict``) as the layout before 2026-12-03 wrote it: the speed settings directly
    under ``train``, beside ``train.fast`` true or false."""
    config = copy.deepcopy(config)
    fast = config["train"].pop("fast")
    config["train"] = {**config["train"], **{k: v for k, v in fast.items() if k != "enabled"}, "fast": fast["enabled"]}
    return config


@pytest.mark.parametrize("fast", [True, False])
def test_a_run_checkpointed_in_the_flat_layout_resumes(tmp_path, fast):
    """A checkpoint whose config is in the layout before 2026-12-03 (train.compile beside train.fast) resumes: the
    run ends with the weights of a straight run, bit for bit (CPU), its folder's config.json is written in today's
    layout, and the checkpoint's config reads as the run's config (as ``cowtune evaluate`` reads it)."""
    cfg = TrainConfig.from_dict({
        "seed": 0, "model": "cnn_tiny", "mix": {"name": "cowmix"},
        "data": {"dataset": "digits", "n_val": 100, "n_labeled": 30},
        "optim": {"lr_per_256": 0.5, "schedule": "constant"},
        "train": {"batch_size": 8, "epochs": 2, "steps_per_epoch": 1, "eval_batch_size": 100, "device": "cpu",
                  "threads": 1, "fast": fast}})
    data = prepare_data(cfg.data, 0, torch.device("cpu"))

    def die(epoch, metrics, path):
        raise KeyboardInterrupt

    fit(cfg, tmp_path / "straight", data=data, log=lambda s: None)
    with pytest.raises(KeyboardInterrupt):
        fit(cfg, tmp_path / "b", data=data, report=die, log=lambda s: None)
    path = tmp_path / "b" / "checkpoint.pt"
    saved = torch.load(path, weights_only=True)
    saved["config"] = flat_layout(saved["config"])
    assert "compile" in saved["config"]["train"] and saved["config"]["train"]["fast"] is fast
    checkpoints.save(saved, path)
    assert TrainConfig.from_dict(torch.load(path, weights_only=True)["config"]) == cfg
    lines = []
    fit(cfg, tmp_path / "b", data=data, log=lines.append)
    assert any(line.startswith(f"resumed from {path} at epoch 1") for line in lines), lines
    a = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=True)
    b = torch.load(path, weights_only=True)
    assert b["epoch"] == 2 and all(torch.equal(a[part][k], b[part][k]) for part in ("student", "teacher")
                                   for k in a[part])
    assert b["config"] == cfg.to_dict() and "compile" not in b["config"]["train"]
