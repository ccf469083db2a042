"""Every run of every accuracy plan (benchmarks/accuracy_runs.py) is a valid config, so a typo in a plan is found
here and not after a GPU lease has started."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from trainables.models import check_model
from trainables.presets import load_config

_SPEC = importlib.util.spec_from_file_location(
    "accuracy_runs", Path(__file__).resolve().parents[1] / "benchmarks" / "accuracy_runs.py")
accuracy_runs = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(accuracy_runs)


@pytest.mark.parametrize("plan", sorted(accuracy_runs.PLANS))
def test_every_run_of_the_plan_resolves_to_a_config(plan):
    builder, epochs = accuracy_runs.PLANS[plan]
    runs = builder(epochs or 300)
    assert runs, f"plan {plan} has no runs"
    for name, overrides in runs.items():
        cfg = load_config(*accuracy_runs.run_settings(overrides, "cifar10_cowmix", "/tmp/train.zip"))
        check_model(cfg.model)
        assert cfg.data.n_val == 5000 and cfg.data.eval_split == "val", f"{plan}/{name} does not score the holdout"
        if any(o.startswith("train.epochs=") for o in overrides):
            assert cfg.train.epochs == int(next(o for o in overrides if o.startswith("train.epochs=")).split("=")[1])


def test_the_jpeg_plan_pairs_each_method_at_both_qualities():
    runs = accuracy_runs.PLANS["ss96_jpeg"][0](60)
    assert sorted(runs) == ["cowmix_q30", "cowmix_q75", "cowout_q30", "cowout_q75", "cutmix_q30", "cutmix_q75",
                            "sup_q30", "sup_q75"]
    for method in ("sup", "cowmix", "cowout", "cutmix"):
        q75, q30 = runs[f"{method}_q75"], runs[f"{method}_q30"]
        assert q30 == [*q75, "data.root=/tmp/cowtune-q30.zip"], "the pair differs in more than the data"


def test_gpus_deal_the_runs_round_robin_in_the_plans_order():
    names = ["cowmix_q75", "cowmix_q30", "cowout_q75"]
    assert accuracy_runs.place_on_gpus(names, "0,1") == {"cowmix_q75": "0", "cowmix_q30": "1", "cowout_q75": "0"}
    assert accuracy_runs.place_on_gpus(names, None) == dict.fromkeys(names)
    with pytest.raises(SystemExit, match="expected comma-separated GPU indices"):
        accuracy_runs.place_on_gpus(names, "0,gpu1")


@pytest.mark.parametrize("argv, says", [
    (["--only", "cowmix_q75,cowmix_q50"], "no run cowmix_q50 in plan ss96_jpeg"),
    (["--gpus", "0,1", "--world", "2"], "--gpus deals one-GPU runs out over GPUs"),
])
def test_launch_refuses_a_bad_selection_before_starting_anything(tmp_path, monkeypatch, argv, says):
    monkeypatch.setattr("sys.argv", ["accuracy_runs.py", "launch", "--plan", "ss96_jpeg", "--data", "/tmp/train.zip",
                                     "--dir", str(tmp_path / "acc"), *argv])
    with pytest.raises(SystemExit, match=says):
        accuracy_runs.main()
    assert not (tmp_path / "acc").exists()
