"""ASHA stops a trial in a real search, and every record says so: Optuna holds it as PRUNED with its
curve up to the stop, and its Ray results and MLflow run end at the epoch it was stopped at.

The stop is deterministic: trials run one at a time; the paper's point comes first, with a learning
rate that learns (teacher error ~0.6 after epoch 1); the second point's learning rate is ~0, so its
teacher stays at its random initialisation (error ~0.9). With grace period 1 and reduction factor 2,
ASHA's first rung (epoch 1) holds only the first trial's error, and must stop the second one there.
A third trial comes from seeded TPE; whether ASHA stops it or not, the same rules must hold for it.
"""
import json
import math
import sys
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient

from conftest import run_checked
from trainables import metrics as M
from trainables.search.studies import BudgetAwareOptunaSearch
from trainables.search.intervals import Float

pytestmark = pytest.mark.slow
EPOCHS, GOOD_LR, BAD_LR = 4, 0.5, 1e-6
SPACE = {"optim": {"lr_per_256": Float(1e-6, 1.0, log=True)}}
SCRIPT = f'''
from search_spaces.cifar10_cowmix import BASE
from trainables.search.driver import SearchSettings, run_search
from trainables.search.intervals import Float

SPACE = {SPACE!r}
SEARCH = SearchSettings(name="asha", grace_period=1, reduction_factor=2,
                        points=({{"optim": {{"lr_per_256": {BAD_LR!r}}}}},))   # tried right after the paper's point
run_search(BASE, SPACE, SEARCH)
'''
# Small and stable: 20 steps an epoch, a weak CowMix weight and a fast teacher, so the good learning
# rate is well below chance at epoch 1 (~0.6 against 0.9 on this data, see the assertion below).
BASE_SET = [f"optim.lr_per_256={GOOD_LR}", "train.steps_per_epoch=20", "mix.weight=1.0", "teacher.alpha=0.5"]


@pytest.fixture(scope="module")
def asha_search(search_env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("asha")
    (tmp / "asha_search.py").write_text(SCRIPT)
    out = run_checked([sys.executable, str(tmp / "asha_search.py"), "--smoke-test", "--trials", "3",
                       "--epochs", str(EPOCHS), "--concurrency", "1", "--name", "asha", "--storage", str(tmp / "ray"),
                       *[a for kv in BASE_SET for a in ("--set", kv)]], search_env, tmp)
    return tmp / "ray" / "asha", out


def ray_trials(exp: Path) -> dict[str, tuple[float, dict[int, float]]]:
    """Ray trial id -> (its learning rate, {epoch: teacher error}) as Ray's result.json recorded them."""
    out = {}
    for d in exp.glob("train_trial_*"):
        rows = [json.loads(line) for line in (d / "result.json").read_text().splitlines()]
        lr = json.loads((d / "params.json").read_text())["optim"]["lr_per_256"]
        out[rows[0]["trial_id"]] = (lr, {r[M.EPOCH]: r[M.VAL_ERROR_TEACHER] for r in rows})
    return out


def optuna_study(exp: Path) -> optuna.Study:
    """The study as Ray saved the searcher in the experiment folder (what `Tuner.restore` resumes from)."""
    searcher = BudgetAwareOptunaSearch(SPACE, EPOCHS, metric=M.VAL_ERROR_TEACHER, mode="min")
    searcher.restore_from_dir(str(exp))
    return searcher._ot_study


def test_asha_stops_the_near_zero_lr_trial_at_the_first_rung(asha_search):
    exp, out = asha_search
    assert "grace 1 epochs" in out.stdout and "done: 3 trials (0 failed)" in out.stdout
    trials = ray_trials(exp)
    assert len(trials) == 3
    (good,) = [c for lr, c in trials.values() if lr == GOOD_LR]
    (bad,) = [c for lr, c in trials.values() if lr == BAD_LR]
    assert sorted(good) == list(range(1, EPOCHS + 1))               # the paper's point ran its full budget
    assert sorted(bad) == [1]                                       # stopped at the first rung, not run to epoch 4
    assert bad[1] >= 0.85 and good[1] <= bad[1] - 0.15              # the margin that makes the stop deterministic


def test_stopped_trials_are_pruned_with_their_curve_and_full_ones_complete(asha_search):
    exp, _ = asha_search
    trials, study = ray_trials(exp), optuna_study(exp)
    by_lr = {t.params["optim.lr_per_256"]: t for t in study.get_trials(deepcopy=False)}
    assert len(by_lr) == 3 and set(by_lr) == {lr for lr, _ in trials.values()}
    assert [t.params["optim.lr_per_256"] for t in sorted(by_lr.values(), key=lambda t: t.number)][:2] == [GOOD_LR, BAD_LR]
    states = set()
    for lr, curve in trials.values():
        t = by_lr[lr]
        last = max(curve)
        assert t.intermediate_values == pytest.approx(curve), lr   # every epoch Ray saw, the stopping one included
        if last < EPOCHS:
            assert t.state == optuna.trial.TrialState.PRUNED, (lr, t.state)
            assert t.value == pytest.approx(curve[last])               # Optuna ranks it by where it was stopped
        else:
            assert t.state == optuna.trial.TrialState.COMPLETE and t.value == pytest.approx(curve[EPOCHS]), lr
        states.add(t.state)
    assert optuna.trial.TrialState.PRUNED in states and optuna.trial.TrialState.COMPLETE in states


def test_mlflow_runs_end_where_ray_stopped_them(asha_search, mlflow_server):
    exp, _ = asha_search
    trials = ray_trials(exp)
    client = MlflowClient(mlflow_server)
    runs = client.search_runs([client.get_experiment_by_name("asha").experiment_id], max_results=100)
    children = {r.data.tags["ray.trial_id"]: r for r in runs if "mlflow.parentRunId" in r.data.tags}
    assert set(children) == set(trials)
    for trial_id, (lr, curve) in trials.items():
        run, last = children[trial_id], max(curve)
        assert run.info.status == "FINISHED", lr
        history = {int(m.step): m.value for m in client.get_metric_history(run.info.run_id, M.VAL_ERROR_TEACHER)}
        assert history == pytest.approx(curve) and all(math.isfinite(v) for v in history.values()), lr
        assert run.data.tags["cowtune.final_epoch"] == str(last)
        assert run.data.tags["cowtune.stopped_early"] == str(last < EPOCHS), lr
    bad = [tid for tid, (lr, _) in trials.items() if lr == BAD_LR]
    assert children[bad[0]].data.tags["cowtune.stopped_early"] == "True"
