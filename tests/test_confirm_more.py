"""More seeds for a finished confirm stage (`trainables.search.more_seeds`), on a real search (Ray, an `mlflow
server`, digits, the tiny model): only the missing (config, seed) runs train, the gate judges again over every
seed, and `cowtune promote` reads the new verdict.

The search has two trials: the "paper's" point (a weak learning rate) and a learning rate that learns. The stage
confirms the one finalist on seeds 1-3; `cowtune confirm --seeds 5` then brings it and the paper's config to 5.
"""
import json
import sys

import pytest
import yaml
from mlflow.tracking import MlflowClient

from conftest import run_checked

pytestmark = pytest.mark.slow
WEAK_LR, GOOD_LR = 0.02, 0.5
SCRIPT = f'''
from search_spaces.cifar10_cowmix import BASE
from trainables.search.driver import Confirm, SearchSettings, run_search
from trainables.search.intervals import Choice

SPACE = {{"optim": {{"lr_per_256": Choice([{WEAK_LR!r}, {GOOD_LR!r}])}}}}
SEARCH = SearchSettings(name="more", mean_of_last=2, grace_period=2,
                        confirm=Confirm(finalists=1, seeds=(1, 2, 3), max_std=0.2, max_rise=0.2),
                        points=({{"optim": {{"lr_per_256": {GOOD_LR!r}}}}},))
run_search(BASE, SPACE, SEARCH)
'''
SETS = [f"optim.lr_per_256={WEAK_LR}", "train.steps_per_epoch=12", "mix.weight=1.0", "teacher.alpha=0.5"]
MORE = [sys.executable, "-m", "trainables.cli", "confirm"]


def _parent_and_record(client, tmp):
    exp = client.get_experiment_by_name("more")
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    record = json.loads(open(client.download_artifacts(parent.info.run_id, "confirm.json", str(tmp))).read())
    return parent, [r for r in runs if r.data.tags.get("cowtune.stage") == "confirm"], record


@pytest.fixture(scope="module")
def extended(search_env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("more")
    (tmp / "more_search.py").write_text(SCRIPT)
    run_checked([sys.executable, str(tmp / "more_search.py"), "--smoke-test", "--trials", "2", "--epochs", "2",
                 "--concurrency", "1", "--name", "more", "--storage", str(tmp / "ray"),
                 *[a for kv in SETS for a in ("--set", kv)]], search_env, tmp)
    client = MlflowClient(search_env["MLFLOW_TRACKING_URI"])
    before = _parent_and_record(client, tmp / "before")
    out = run_checked([*MORE, "--search", "more", "--seeds", "5", "--concurrency", "1",
                       "--storage", str(tmp / "ray")], search_env, tmp)
    return tmp, client, before, _parent_and_record(client, tmp / "after"), out


def test_only_the_new_seeds_train_and_the_gate_judges_all_of_them(extended):
    _, _, (_, runs_before, before), (parent, runs, after), out = extended
    assert len(runs_before) == 6 and before["seeds"] == [1, 2, 3]
    old = {r.info.run_id for r in runs_before}
    new = sorted((r.data.tags["cowtune.candidate"], r.data.params["seed"]) for r in runs if r.info.run_id not in old)
    labels = sorted(r["label"] for r in before["rows"])
    assert new == sorted((label, s) for label in labels for s in ("4", "5"))   # 4 runs, none trained twice
    rows = {r["label"]: r for r in after["rows"]}
    assert after["seeds"] == [1, 2, 3, 4, 5] and all(sorted(r["objective"]) == list("12345") for r in rows.values())
    for label, row in {r["label"]: r for r in before["rows"]}.items():   # the old seeds' values read back unchanged
        assert all(rows[label]["objective"][s] == pytest.approx(v) for s, v in row["objective"].items())
    winner = rows[after["winner"]]
    assert after["winner"] != "paper" and winner["verdict"] == "promoted" and winner["p_value"] < 0.1
    assert after["winner_config"]["optim"]["lr_per_256"] == GOOD_LR and after["metric"] == "val/error_teacher"
    assert parent.data.tags["cowtune.confirm.runs"] == "10" and "seeds 1, 2, 3, 4, 5" in out.stdout
    assert parent.data.metrics[f"confirm.{after['winner']}.p_vs_paper"] == pytest.approx(winner["p_value"])


def test_promote_registers_the_median_of_the_five_seeds(extended, search_env):
    tmp, client, _, (_, runs, after), _ = extended
    run_checked([sys.executable, "-m", "trainables.cli", "promote", "--search", "more", "--out",
                 str(tmp / "promoted.yaml")], search_env, tmp)
    text = (tmp / "promoted.yaml").read_text()
    assert yaml.safe_load(text)["optim"]["lr_per_256"] == GOOD_LR and "over seeds 1, 2, 3, 4, 5" in text
    row = next(r for r in after["rows"] if r["label"] == after["winner"])
    median_seed = sorted(row["objective"], key=row["objective"].get)[2]
    version = client.get_model_version_by_alias("more", "champion")
    assert client.get_run(version.run_id).data.tags["cowtune.confirm_seed"] == median_seed


def test_bad_requests_are_one_line(extended, search_env):
    tmp = extended[0]
    for argv, said in ((["--search", "more", "--seeds", "5", "--only", "nope"], "--only must name finalists of the stage"),
                       (["--search", "nosuch", "--seeds", "5"], "Unknown search 'nosuch'"),
                       (["--search", "more", "--seeds", "2"], "--seeds must be at least 3")):
        out = subprocess_run([*MORE, *argv], search_env, tmp)
        assert out.returncode == 2 and said in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_the_same_command_again_trains_nothing_and_judges_the_same(extended, search_env):
    tmp, client, _, (_, runs, after), _ = extended
    out = run_checked([*MORE, "--search", "more", "--seeds", "5", "--storage", str(tmp / "ray")], search_env, tmp)
    assert "every run of seeds 1-5 has finished; judging them again" in out.stdout
    parent, runs_again, again = _parent_and_record(client, tmp / "again")
    assert len(runs_again) == len(runs) == 10 and again["winner"] == after["winner"]
    assert [r["objective"] for r in again["rows"]] == [r["objective"] for r in after["rows"]]


def subprocess_run(cmd, env, cwd):
    import subprocess

    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
