"""The confirm stage and the gate in a real search (local Ray, an `mlflow server`, digits, the tiny model): a
config whose lead was seed luck is not promoted, a config better over fresh seeds is.

The search's three trials are fixed: the "paper's" point (a weak learning rate, 0.02), the same config on another
training seed (``seed`` is in the space: whatever it scores in the search is luck, as it is the paper's config),
and a learning rate that learns (0.5). Both finalists and the paper's config then train on seeds 1, 2, 3 (two
epochs of 12 steps spread a tiny model's seeds by up to 11 points, so the search file allows 20). On fresh
seeds the lucky one is the paper's config run for run (the stage sets the seed), so its paired differences are all
0 and it must not be promoted; the learning rate that learns must be, and `cowtune promote` writes it.

Then `cowtune confirm --seeds 5` (``trainables.search.promote``) brings the leader and the paper's config to 5
seeds from the MLflow store: only those 4 runs train, the gate judges again over every seed, `cowtune promote`
registers the median of the five, and the same command again trains nothing.
"""
import json
import sys

import pytest
import yaml
from mlflow.tracking import MlflowClient

from conftest import run_checked
from trainables import metrics as M

pytestmark = pytest.mark.slow
WEAK_LR, GOOD_LR = 0.02, 0.5
SCRIPT = f'''
from search_spaces.cifar10_cowmix import BASE
from trainables.search.driver import Confirm, SearchSettings, run_search
from trainables.search.intervals import Choice

SPACE = {{"seed": Choice([0, 1]), "optim": {{"lr_per_256": Choice([{WEAK_LR!r}, {GOOD_LR!r}])}}}}
SEARCH = SearchSettings(name="confirm", mean_of_last=2, grace_period=2,   # no early stop: each trial trains it all
                        confirm=Confirm(finalists=2, seeds=(1, 2, 3), max_std=0.2, max_rise=0.2),
                        points=({{"seed": 1}}, {{"optim": {{"lr_per_256": {GOOD_LR!r}}}}}))
run_search(BASE, SPACE, SEARCH)
'''
BASE_SET = [f"optim.lr_per_256={WEAK_LR}", "train.steps_per_epoch=12", "mix.weight=1.0", "teacher.alpha=0.5"]
COWTUNE = [sys.executable, "-m", "trainables.cli"]


@pytest.fixture(scope="module")
def confirmed(search_env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("confirm")
    (tmp / "confirm_search.py").write_text(SCRIPT)
    out = run_checked([sys.executable, str(tmp / "confirm_search.py"), "--smoke-test", "--trials", "3", "--epochs",
                       "2", "--concurrency", "1", "--name", "confirm", "--storage", str(tmp / "ray"),
                       *[a for kv in BASE_SET for a in ("--set", kv)]], search_env, tmp)
    client = MlflowClient(search_env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("confirm")
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    record = json.loads(open(client.download_artifacts(parent.info.run_id, "confirm.json", str(tmp))).read())
    return tmp, out, client, parent, runs, record


def test_the_lucky_config_is_the_paper_run_for_run_and_loses(confirmed):
    _, out, _, _, _, record = confirmed
    rows = {r["label"]: r for r in record["rows"]}
    assert len(rows) == 3 and record["objective"] == "val/error_teacher_mean2"
    paper = rows["paper"]
    lucky = next(r for k, r in rows.items() if k != "paper" and r["objective"] == paper["objective"])
    assert "not below" in lucky["verdict"] and lucky["p_value"] == 1.0
    assert lucky["search_value"] is not None and lucky["search_value"] != paper["search_value"]   # it had a lead or a lag


def test_the_better_config_wins_over_fresh_seeds_and_is_promoted(confirmed, search_env):
    tmp, out, client, parent, runs, record = confirmed
    rows = {r["label"]: r for r in record["rows"]}
    winner = rows[record["winner"]]
    assert record["winner"] != "paper" and winner["verdict"] == "promoted", record
    assert record["winner_config"]["optim"]["lr_per_256"] == GOOD_LR
    assert all(winner["objective"][s] < rows["paper"]["objective"][s] for s in ("1", "2", "3"))
    assert winner["p_value"] < 0.1 and winner["mean"] < rows["paper"]["mean"] - 0.05
    assert f"confirm: {record['winner']} beats the paper's config over seeds" in out.stdout
    # The parent run: the winner, each config's mean, std and p, one trial's noise at the rungs, the table
    m, tags = parent.data.metrics, parent.data.tags
    assert tags["cowtune.confirm.winner"] == record["winner"] and tags["cowtune.confirm.runs"] == "9"
    assert m[f"confirm.{record['winner']}.p_vs_paper"] == pytest.approx(winner["p_value"])
    assert m["confirm.paper.mean"] == pytest.approx(rows["paper"]["mean"]) and "confirm.paper.std" in m
    assert any(k.startswith("noise.std.e") for k in m) and "**Confirm stage**" in tags["mlflow.note.content"]
    # Nine confirm runs, tagged, on seeds 1-3 each; every trial and run reports the objective
    stage = [r for r in runs if r.data.tags.get("cowtune.stage") == "confirm"]
    assert sorted((r.data.tags["cowtune.candidate"], r.data.params["seed"]) for r in stage) == sorted(
        (label, s) for label in rows for s in ("1", "2", "3"))
    assert all(M.mean_of_last(M.VAL_ERROR_TEACHER, 2) in r.data.metrics for r in runs if r is not parent)
    # promote writes the winner's config (the search's seed, no CPU share) and registers its median seed's run
    run_checked([*COWTUNE, "promote", "--search", "confirm", "--out", str(tmp / "promoted.yaml")], search_env, tmp)
    text = (tmp / "promoted.yaml").read_text()
    promoted = yaml.safe_load(text)
    assert promoted["optim"]["lr_per_256"] == GOOD_LR and promoted["seed"] == 0
    assert "threads" not in promoted["train"] and "# gate: promoted" in text and "p_vs_paper" in text
    version = client.get_model_version_by_alias("confirm", "champion")
    assert client.get_run(version.run_id).data.tags["cowtune.candidate"] == record["winner"]


# --- More seeds later: `cowtune confirm --search confirm --seeds 5` ---------------------------------------------------

MORE = [*COWTUNE, "confirm"]


def _parent_and_record(client, tmp):
    exp = client.get_experiment_by_name("confirm")
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    record = json.loads(open(client.download_artifacts(parent.info.run_id, "confirm.json", str(tmp))).read())
    return parent, [r for r in runs if r.data.tags.get("cowtune.stage") == "confirm"], record


@pytest.fixture(scope="module")
def extended(confirmed, search_env):
    tmp, _, client, _, runs, before = confirmed
    out = run_checked([*MORE, "--search", "confirm", "--seeds", "5", "--concurrency", "1",
                       "--storage", str(tmp / "ray")], search_env, tmp)
    stage_before = [r for r in runs if r.data.tags.get("cowtune.stage") == "confirm"]
    return tmp, client, (stage_before, before), _parent_and_record(client, tmp / "after"), out


def test_more_seeds_train_only_the_missing_runs_of_the_leader_and_the_paper(extended):
    _, _, (runs_before, before), (parent, runs, after), out = extended
    assert len(runs_before) == 9 and before["seeds"] == [1, 2, 3]
    old = {r.info.run_id for r in runs_before}
    new = sorted((r.data.tags["cowtune.candidate"], r.data.params["seed"]) for r in runs if r.info.run_id not in old)
    assert new == sorted((label, s) for label in ("paper", before["winner"]) for s in ("4", "5"))
    rows = {r["label"]: r for r in after["rows"]}
    assert after["seeds"] == [1, 2, 3, 4, 5]
    assert sorted(rows["paper"]["objective"]) == sorted(rows[after["winner"]]["objective"]) == list("12345")
    lucky = next(label for label in rows if label not in ("paper", after["winner"]))
    assert sorted(rows[lucky]["objective"]) == list("123") and rows[lucky]["verdict"].startswith("not extended (3 seeds)")
    for label, row in {r["label"]: r for r in before["rows"]}.items():   # the old seeds' values read back unchanged
        assert all(rows[label]["objective"][s] == pytest.approx(v) for s, v in row["objective"].items())
    winner = rows[after["winner"]]
    assert after["winner"] == before["winner"] and winner["verdict"] == "promoted" and winner["p_value"] < 0.1
    assert after["winner_config"]["optim"]["lr_per_256"] == GOOD_LR and after["metric"] == "val/error_teacher"
    assert parent.data.tags["cowtune.confirm.runs"] == "13" and "seeds 1, 2, 3, 4, 5" in out.stdout
    assert parent.data.metrics[f"confirm.{after['winner']}.p_vs_paper"] == pytest.approx(winner["p_value"])


def test_promote_after_more_seeds_registers_the_median_of_the_five(extended, search_env):
    tmp, client, _, (_, _, after), _ = extended
    run_checked([*COWTUNE, "promote", "--search", "confirm", "--out", str(tmp / "promoted5.yaml")], search_env, tmp)
    text = (tmp / "promoted5.yaml").read_text()
    assert yaml.safe_load(text)["optim"]["lr_per_256"] == GOOD_LR and "over seeds 1, 2, 3, 4, 5" in text
    row = next(r for r in after["rows"] if r["label"] == after["winner"])
    median_seed = sorted(row["objective"], key=row["objective"].get)[2]
    version = client.get_model_version_by_alias("confirm", "champion")
    assert client.get_run(version.run_id).data.tags["cowtune.confirm_seed"] == median_seed


def test_more_seeds_bad_requests_are_one_line(extended, search_env):
    import subprocess

    tmp = extended[0]
    for argv, said in ((["--search", "confirm", "--seeds", "5", "--only", "nope"],
                        "--only must name finalists of the stage"),
                       (["--search", "nosuch", "--seeds", "5"], "Unknown search 'nosuch'"),
                       (["--search", "confirm", "--seeds", "2"], "--seeds must be at least 3")):
        out = subprocess.run([*MORE, *argv], env=search_env, cwd=tmp, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and said in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_more_seeds_again_trains_nothing_and_judges_the_same(extended, search_env):
    tmp, client, _, (_, runs, after), _ = extended
    out = run_checked([*MORE, "--search", "confirm", "--seeds", "5", "--storage", str(tmp / "ray")], search_env, tmp)
    assert "every run of seeds 1-5 has finished; judging them again" in out.stdout
    _, runs_again, again = _parent_and_record(client, tmp / "again")
    assert len(runs_again) == len(runs) == 13 and again["winner"] == after["winner"]
    assert [r["objective"] for r in again["rows"]] == [r["objective"] for r in after["rows"]]
