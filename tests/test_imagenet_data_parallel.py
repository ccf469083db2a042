"""Data-parallel training on the large-image path (JPEG files: ``LoaderData``, PIL; ``DecodedData``, decoded as tensor
ops) is one process's run split over workers: each worker's slice is its part of the one-process batch, and two
gloo workers on CPU reach the gradients (so the weights) of one process over the whole global batch.

The workers are real processes meeting in real collectives (torch.distributed over gloo); the model is tiny.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from imagenet_trees import jpeg_tree
from trainables import data as D
from trainables.config import DataConfig, TrainConfig
from trainables.data_parallel import launch_local
from trainables.models import create_model

CPU = torch.device("cpu")
FIELDS = ("x_sup", "y_sup", "x_unsup0", "x_unsup1")


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return jpeg_tree(tmp_path_factory.mktemp("imagenet_dp"), {f"n{c:08d}": 8 for c in range(4)}, val_per_class=2)


def data_config(tree, decode: str) -> DataConfig:
    return DataConfig(dataset="imagefolder", root=str(tree), n_val=0, eval_split="test", n_labeled=8,
                      pipeline="loader", decode=decode, workers=0, image_size=24, colour_jitter=True)


@pytest.mark.parametrize("decode", ["pil", "device"])
@pytest.mark.parametrize("twice", [False, True])
def test_each_workers_slice_of_a_large_image_batch_is_its_part_of_the_whole(tree, decode, twice):
    data = D.prepare_data(data_config(tree, decode), 0, CPU)
    assert type(data) is (D.LoaderData if decode == "pil" else D.DecodedData)
    whole = list(data.train_batches(2, 5, 8, 2, twice))
    slices = [list(data.train_batches(2, 5, 8, 2, twice, shard=(r, 2))) for r in range(2)]
    for step, batch in enumerate(whole):
        for i, name in enumerate(FIELDS):
            parts = [dataclasses.astuple(s[step])[i] for s in slices]
            assert all(p.shape[0] == 4 for p in parts)
            assert torch.equal(torch.cat(parts), dataclasses.astuple(batch)[i]), (decode, step, name)
        assert (batch.x_unsup1 is batch.x_unsup0) == (not twice)


def config(tree, decode: str, **train) -> TrainConfig:
    return TrainConfig.from_dict({
        "seed": 0, "model": "cnn_tiny", "mix": None, "perturb": None,
        "data": dataclasses.asdict(data_config(tree, decode)),
        "optim": {"lr_per_256": 4.0, "schedule": "constant"},
        "train": {"batch_size": 8, "epochs": 1, "steps_per_epoch": 2, "eval_batch_size": 8, "device": "cpu",
                  "threads": 1, "compile": False, **train}})


def test_two_gloo_workers_on_jpeg_files_train_the_weights_of_one_process(tree, tmp_path):
    """Supervised steps have no per-worker randomness: 2 workers, each decoding its 4 of the 8 images of a step and
    normalising its batch norm over them, must reach the weights of 1 process that decodes all 8 and normalises in
    groups of 4 (train.bn_batch), to float rounding: the global batch and the averaged gradients are the same."""
    two = launch_local(config(tree, "device"), 2, tmp_path / "two")
    one = launch_local(config(tree, "device", bn_batch=4), 1, tmp_path / "one")
    a = torch.load(tmp_path / "two" / "state.pt", weights_only=True)["student"]
    b = torch.load(tmp_path / "one" / "state.pt", weights_only=True)["student"]
    torch.manual_seed(0)
    start = create_model("cnn_tiny", 4).state_dict()   # the weights both began from (build_runner seeds the same)
    params = [k for k in a if "running" not in k and "num_batches" not in k]
    assert params and all(torch.allclose(a[k], b[k], atol=1e-5, rtol=1e-4) for k in params)
    assert max((a[k] - start[k]).abs().max().item() for k in params) > 1e-3     # and they did move
    assert two[-1]["world_size"] == 2 and two[-1]["replica_spread"] == 0.0
    assert two[-1]["train/loss_sup"] == pytest.approx(one[-1]["train/loss_sup"], rel=1e-4)   # the whole batch's
    assert two[-1]["test/error_teacher"] == pytest.approx(one[-1]["test/error_teacher"])     # 8 val images, sharded
