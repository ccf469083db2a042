"""A search's checks and output that need no Ray or MLflow service (issue 54; what needs them is in
tests/test_bad_inputs.py, beyond the table): the data against the holdout and labels, the MLflow link, ties."""
from __future__ import annotations

import pytest

from trainables.config import TrainConfig
from trainables.validation import ConfigError


def test_a_dataset_of_known_size_is_checked_against_the_labels_without_its_files():
    """CIFAR-10 (50,000 images, 10 balanced classes) before a download: the labeled subset must fit what the holdout
    leaves; digits' 1,797 images likewise. Nothing is read but scikit-learn's digits."""
    from trainables.search.settings import check_splits

    def cfg(dataset: str, **data) -> TrainConfig:
        return TrainConfig.from_dict({"data": {"dataset": dataset, "root": "/nowhere", "eval_split": "val", **data}})

    check_splits(cfg("cifar10", n_val=5000, n_labeled=1000))
    with pytest.raises(ConfigError, match=r"data.n_labeled must be at most the 45000 images left after the "
                                          r"validation holdout of 5000 .*got 46000"):
        check_splits(cfg("cifar10", n_val=5000, n_labeled=46000))
    with pytest.raises(ConfigError, match=r"data.n_val must be smaller than the training split \(1797 images\)"):
        check_splits(cfg("digits", n_val=5000, n_labeled=50))
    check_splits(cfg("imagefolder", n_val=5000), listed=False)   # --skip-data-check: only the workers hold it
