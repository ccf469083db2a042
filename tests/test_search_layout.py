"""A search recorded before the speed settings moved into ``train.fast`` (2026-12-03) resumes with its own settings:
its parent run's parameters are read in today's layout before they are compared, and a real difference is still
named, in today's key. On a real MLflow store (SQLite), with the parameters a search of that layout recorded."""
from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from trainables.config import TrainConfig
from trainables.presets import load_config
from trainables.search.experiments import check_same_settings, params_in_todays_layout, setting_params
from trainables.validation import ConfigError, flatten

pytestmark = pytest.mark.slow   # an MLflow store's migrations: seconds on 2 cores


def _recorded_before_the_move(today: dict[str, str]) -> dict[str, str]:
    """The parameters the same search recorded in the flat layout: ``config.train.compile``, ``config.train.fast``."""
    old = {}
    for key, value in today.items():
        if key == "config.train.fast.enabled":
            old["config.train.fast"] = value
        elif key.startswith("config.train.fast."):
            old["config.train." + key.removeprefix("config.train.fast.")] = value
        else:
            old[key] = value
    return old


def test_a_search_recorded_in_the_flat_layout_resumes_and_a_real_difference_is_named(tmp_path):
    config = TrainConfig.from_dict({**load_config("cifar10_cowmix").to_dict(), "model": "cnn_tiny"})
    today = setting_params({f"config.{k}": v for k, v in flatten(config.to_dict()).items()} | {"search.trials": 3})
    assert "config.train.fast.compile" in today and "config.train.compile" not in today
    old = _recorded_before_the_move(today)
    assert "config.train.compile" in old and "config.train.fast" in old and params_in_todays_layout(old) == today

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("flat", artifact_location=str(tmp_path / "art"))
    run_id = client.create_run(experiment).info.run_id
    for key, value in old.items():
        client.log_param(run_id, key, value)
    parent = client.get_run(run_id)

    check_same_settings("flat", parent, today, {})   # its own settings: accepted
    compile_was = today["config.train.fast.compile"]
    changed = {**today, "config.train.fast.compile": "false" if compile_was != "false" else "true",
               "config.mix.weight": "5.5"}
    with pytest.raises(ConfigError) as err:
        check_same_settings("flat", parent, changed, {})
    message = str(err.value)
    assert "config.mix.weight (30.0 -> 5.5)" in message and f"config.train.fast.compile ({compile_was} -> {changed['config.train.fast.compile']})" in message
    assert "config.train.compile " not in message
