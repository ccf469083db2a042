"""A search's checks and output that need no Ray or MLflow service (issue 54; what needs them is in
tests/test_bad_inputs.py, beyond the table): the data against the holdout and labels, the MLflow link, ties."""
from __future__ import annotations

import pytest

from trainables.config import TrainConfig
from trainables.validation import ConfigError


def test_a_dataset_of_known_size_is_checked_against_the_labels_without_its_files():
    """CIFAR-10 (50,000 images, 10 balanced classes) before a download: the labeled subset must fit what the holdout
    leaves; digits' 1,797 images likewise. Nothing is read but scikit-learn's digits."""
    from trainables.search.plan import check_splits

    def cfg(dataset: str, **data) -> TrainConfig:
        return TrainConfig.from_dict({"data": {"dataset": dataset, "root": "/nowhere", "eval_split": "val", **data}})

    check_splits(cfg("cifar10", n_val=5000, n_labeled=1000))
    with pytest.raises(ConfigError, match=r"data.n_labeled must be at most the 45000 images left after the "
                                          r"validation holdout of 5000 .*got 46000"):
        check_splits(cfg("cifar10", n_val=5000, n_labeled=46000))
    with pytest.raises(ConfigError, match=r"data.n_val must be smaller than the training split \(1797 images\)"):
        check_splits(cfg("digits", n_val=5000, n_labeled=50))
    check_splits(cfg("imagefolder", n_val=5000), listed=False)   # --skip-data-check: only the workers hold it


def test_every_child_run_logs_each_range_as_numeric_lo_and_hi_params(tmp_path):
    """A trial's MLflow run (a real SQLite store) has mix.sigma_range and mix.prop_range as numbers, lo and hi, for
    MLflow's compare and parallel-coordinates views, besides the list as text."""
    from mlflow.tracking import MlflowClient

    from trainables.search.mlflow_runs import TrialRun

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment_id = client.create_experiment("ranges", artifact_location=(tmp_path / "a").as_uri())
    parent = client.create_run(experiment_id).info.run_id
    config = TrainConfig.from_dict({"mix": {"name": "cowmix", "sigma_range": [2.68, 21.59], "prop_range": [0.2, 0.8]},
                                    "data": {"dataset": "digits"}}).to_dict()
    (tmp_path / "trial").mkdir()
    run = TrialRun(uri, experiment_id, parent, "t0001", "train_trial_t0001", tmp_path / "trial", config, {},
                   log=lambda s: None)
    params = client.get_run(run.run_id).data.params
    assert {k: float(params[k]) for k in params if k.endswith((".lo", ".hi"))} == {
        "mix.sigma_range.lo": 2.68, "mix.sigma_range.hi": 21.59, "mix.prop_range.lo": 0.2, "mix.prop_range.hi": 0.8}
    assert params["mix.sigma_range"] == "[2.68, 21.59]"
