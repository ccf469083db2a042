"""Data-parallel evaluation reads only its worker's batches: ``eval_batches(split, b, shard=(rank, world))`` of every
pipeline gives batch k of the whole split for k % world == rank, and the workers' shards together are the whole split
in order, so no worker decodes the others' images (ImageNet's 50,000 validation JPEGs once, not once a GPU)."""
from __future__ import annotations

import pytest
import torch

from imagenet_trees import jpeg_tree
from trainables import data as D
from trainables.config import DataConfig

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return jpeg_tree(tmp_path_factory.mktemp("shards"), {f"n{c:08d}": 6 for c in range(4)}, val_per_class=3)


def pipelines(tree) -> dict[str, D.TrainData]:
    files = lambda decode, **kw: DataConfig(dataset="imagefolder", root=str(tree), n_val=7, n_labeled=8,
                                            pipeline="loader", decode=decode, workers=0, image_size=24, **kw)
    return {"device (in memory)": D.prepare_data(DataConfig(dataset="digits", n_val=23, n_labeled=40), 0, CPU),
            "pil": D.prepare_data(files("pil"), 0, CPU),
            "decode_jpeg": D.prepare_data(files("device"), 0, CPU),
            "hybrid": D.prepare_data(files("hybrid", cpu_fraction=0.5), 0, CPU)}


@pytest.mark.parametrize("world", [2, 3])
def test_the_workers_shards_are_the_whole_split_and_each_reads_only_its_own(tree, world):
    for name, data in pipelines(tree).items():
        for split in ("val", "test") if name == "pil" else ("val",):
            whole = list(data.eval_batches(split, 2))
            shards = [list(data.eval_batches(split, 2, shard=(rank, world))) for rank in range(world)]
            assert [len(s) for s in shards] == [len(whole[r::world]) for r in range(world)], name
            for rank, shard in enumerate(shards):
                for (x, y), (wx, wy) in zip(shard, whole[rank::world]):
                    assert torch.equal(y, wy) and torch.equal(x, wx), (name, split, rank)
            assert sum(y.shape[0] for s in shards for _, y in s) == sum(y.shape[0] for _, y in whole) > 2 * world


def test_the_device_decode_reads_only_its_shards_files(tree):
    for name in ("decode_jpeg", "hybrid"):
        data = pipelines(tree)[name]
        read, original = [], data._read
        data._read = lambda split, idx: read.append(list(idx)) or original(split, idx)
        list(data.eval_batches("val", 2, shard=(1, 3)))
        val = list(data.splits.val)
        assert len(val) == 7 and read == [val[2:4]], name   # batches of 2 over 7 rows, world 3: rank 1 has batch 1 only
