"""ImageNet-style final training: ResNet-152, 10% labels, scaled sigma, data-parallel on 2 Ray Train workers (gloo, CPU)."""
import sys

import pytest
import yaml
from mlflow.tracking import MlflowClient

from conftest import run_checked

from trainables.search.final import final_configs, imagenet_sigma_scale
from trainables.validation import ConfigError

PROMOTED = {"seed": 0, "model": "cnn_tiny", "data": {"dataset": "digits", "n_val": 200, "n_labeled": 50},
            "mix": {"name": "cowmix", "sigma_range": [4.0, 16.0], "prop_range": [0.2, 0.8]},
            "train": {"batch_size": 4, "epochs": 1, "steps_per_epoch": 2, "eval_batch_size": 25}}
SMALL = ["data.image_size=32", "data.colour_jitter=false", "data.workers=0", "train.threads=1",   # the preset's
         "train.batch_size=4", "train.epochs=1", "train.steps_per_epoch=2", "train.eval_batch_size=25"]   # sizes: 1024 ...


def test_imagenet_runs_use_resnet152_ten_percent_labels_and_scaled_sigma(digits_tree):
    runs = final_configs(PROMOTED, {"imagenet": str(digits_tree)}, None, 2, True, [])
    assert len(runs) == 4 and {r["method"] for r in runs} == {"promoted", "supervised"}
    cfg = runs[0]["config"]
    assert cfg["model"] == "resnet152" and cfg["data"]["image_size"] == 224
    assert cfg["data"]["n_labeled"] == 15                      # 10% of the 150 training images
    assert cfg["mix"]["sigma_range"] == [32.0, 128.0]          # the paper's ImageNet sigma at 224 px
    assert imagenet_sigma_scale(32) == pytest.approx(8 * 32 / 224)
    assert cfg["data"]["eval_split"] == "test" and cfg["data"]["n_val"] == 0


def test_the_final_grid_looks_for_each_datasets_files_unless_told_not_to(tmp_path):
    nowhere = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="data.root.*nowhere"):
        final_configs(PROMOTED, {"cifar10": nowhere}, [250], 1, False, [])
    assert len(final_configs(PROMOTED, {"cifar10": nowhere}, [250], 2, True, [], check_data=False)) == 4
    with pytest.raises(ConfigError, match="--labels"):   # ImageNet's default 10% would count files on the driver
        final_configs(PROMOTED, {"imagenet": nowhere}, None, 1, False, [], check_data=False)
    (run,) = final_configs(PROMOTED, {"imagenet": nowhere}, [100], 1, False, [], check_data=False)
    assert run["config"]["data"]["n_labeled"] == 100 and run["config"]["model"] == "resnet152"


@pytest.mark.slow
def test_imagenet_final_runs_data_parallel_on_two_workers(search_env, mlflow_server, digits_tree, tmp_path):
    """`cowtune final --datasets imagenet=...`: each run is a Tune trial that launches a 2-worker TorchTrainer."""
    (tmp_path / "promoted.yaml").write_text(yaml.safe_dump(PROMOTED))
    sets = [a for s in SMALL for a in ("--set", s)]
    out = run_checked([sys.executable, "-m", "trainables.cli", "final", "--config", str(tmp_path / "promoted.yaml"),
                       "--datasets", f"imagenet={digits_tree}", "--seeds", "1", "--no-supervised", "--ddp-workers", "2",
                       "--name", "fin-imagenet", "--storage", str(tmp_path / "ray"), "--out", str(tmp_path / "final"),
                       *sets], search_env, tmp_path, timeout=400)
    assert "| imagenet | 10% |" in out.stdout and "26.06 ± 0.17" in out.stdout      # next to the paper's number
    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("fin-imagenet")
    children = [r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
    assert len(children) == 1
    m = children[0].data.metrics
    assert m["world_size"] == 2 and m["replica_spread"] == 0.0      # the replicas stayed identical
    assert 0.0 <= m["test/error_teacher"] <= 1.0
    assert children[0].data.params["model"] == "resnet152" and children[0].data.params["data.n_labeled"] == "15"
