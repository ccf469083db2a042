"""``benchmarks/imagenet_pipeline.py`` runs end to end on CPU in its smoke mode: a generated tree of ImageNet's layout,
the four inputs (PIL workers, decode as tensor ops, the hybrid of the two at two fractions, pre-decoded batches
replayed), one JSON line each and a summary (no timing assertions: the numbers that matter are an H200's)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "imagenet_pipeline.py"


def run(tmp_path: Path, *extra: str) -> list[dict]:
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path), *extra], capture_output=True,
                       text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert lines == [json.loads(line) for line in (tmp_path / "imagenet_pipeline.jsonl").read_text().splitlines()]
    return lines


def test_smoke_mode_measures_each_input_and_says_where(tmp_path):
    *cases, summary = run(tmp_path)
    assert [c["case"] for c in cases] == ["pil", "device", "hybrid", "hybrid", "predecoded"]
    assert summary["case"] == "summary" and summary["total_wall_s"] > 0
    for c in cases:
        assert c["model"] == "cnn_tiny" and c["method"] == "cowmix" and c["images_per_step"] == 8
        assert c["steps_per_s"] > 0 and c["images_per_s"] == pytest.approx(8 * c["steps_per_s"], rel=0.01)
        assert c["gpu"] == "cpu" and c["torch"] and c["torchvision"] and c["commit"] and c["tree_files"] == 32
        assert c["wall_s"] >= c["seconds"]
    assert "PIL" in cases[0]["pipeline"] and "decoded on cpu" in cases[1]["pipeline"]
    assert [(c["cpu_fraction"], c["host_rows"], c["workers"]) for c in cases[2:4]] == [(0.7, 3, 2), (0.8, 3, 2)]
    assert "hybrid: PIL in 2 workers for 0.7 of each batch" in cases[2]["pipeline"]
    assert cases[0]["cold_cache"] is cases[1]["cold_cache"] is cases[2]["cold_cache"]
    assert cases[4]["cold_cache"] is False
    assert set(summary["ratio_device_to_predecoded"]) == {"cnn_tiny@4"}
    assert set(summary["ratio_to_predecoded"]["cnn_tiny@4"]) == {"pil", "device", "hybrid 0.7", "hybrid 0.8"}
    assert summary["best_input"]["cnn_tiny@4"] in summary["ratio_to_predecoded"]["cnn_tiny@4"]
    assert summary["auto_rule"]["cnn_tiny@4"] == {"cpu_fraction": 0.125, "measured_ratio": None}   # 2 workers, 4 a step
    tree = json.loads((tmp_path / "smoke-tree" / "tree.json").read_text())
    assert tree["files"] == 32 and sorted(p.name for p in (tmp_path / "smoke-tree").iterdir()) == ["train", "tree.json",
                                                                                                   "val"]


def test_smoke_mode_refuses_an_unknown_case_or_a_fraction_outside_zero_to_one(tmp_path):
    for extra, said in ((["--cases", "pil,gpu"], "--cases: unknown case gpu (known: pil, device, predecoded, hybrid)"),
                        (["--fractions", "0.7,1.5"], "--fractions must be numbers in [0, 1], got '0.7,1.5'")):
        r = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path), *extra],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith(said), r.stderr[-2000:]
        assert not (tmp_path / "smoke-tree").exists()


@pytest.mark.slow
def test_smoke_mode_measures_the_data_parallel_step(tmp_path):
    *cases, summary = run(tmp_path, "--cases", "predecoded", "--world", "1,2")
    scaling = [c for c in cases if c["case"] == "data_parallel"]
    assert [c["world"] for c in scaling] == [1, 2] and all(c["replica_spread"] == 0.0 for c in scaling)
    assert summary["scaling_efficiency"]["cnn_tiny x1"] == 1.0 and summary["scaling_efficiency"]["cnn_tiny x2"] > 0
