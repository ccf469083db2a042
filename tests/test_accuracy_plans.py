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
    assert sorted(runs) == ["cowmix_q30", "cowmix_q75", "cowout_q30", "cowout_q75", "sup_q30", "sup_q75"]
    for method in ("sup", "cowmix", "cowout"):
        q75, q30 = runs[f"{method}_q75"], runs[f"{method}_q30"]
        assert q30 == [*q75, "data.root=/tmp/cowtune-q30.zip"], "the pair differs in more than the data"
