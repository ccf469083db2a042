"""The search's MLflow parent run summary (trainables/search/studies.py) on a real Optuna study and a real MLflow
store: the best trial's error and searched values as metrics and tags, a Description, and the study's plots."""
from __future__ import annotations

import random
from types import SimpleNamespace

import optuna
import pytest
from mlflow.tracking import MlflowClient
from PIL import Image

from trainables.search import intervals, studies

SPACE = {"mix": {"sigma_range": intervals.Interval(1.0, 32.0, log=True, min_width=1.5),
                 "weight": intervals.Float(1.0, 100.0, log=True)},
         "teacher": {"alpha": intervals.Float(0.9, 0.999)}}


def plan(name: str, trials: int) -> SimpleNamespace:
    """What studies.record reads of a search's plan (trainables.search.plan.Plan)."""
    return SimpleNamespace(name=name, epochs=30, grace=8, num_samples=trials)


def _study(n: int, pruned: int = 0) -> optuna.Study:
    """A study over SPACE's parameters with ``n`` complete trials (error grows with the trial number) and ``pruned``
    pruned ones."""
    dists = {k: optuna.distributions.FloatDistribution(s[1], s[2], log=s[3])
             for k, s in intervals.space_params(SPACE).items()}
    study = optuna.create_study(direction="minimize")
    rng = random.Random(0)
    for i in range(n + pruned):
        params = {k: (d.low * (d.high / d.low) ** rng.random()) if d.log else rng.uniform(d.low, d.high)
                  for k, d in dists.items()}
        if i < n:
            study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, value=0.2 + 0.1 * i,
                                                      intermediate_values={1: 0.5, 2: 0.2 + 0.1 * i}))
        else:
            study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, intermediate_values={1: 0.9},
                                                      state=optuna.trial.TrialState.PRUNED))
    return study


def test_the_parent_run_carries_the_best_trial_a_description_and_the_study_plots(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("s", artifact_location=(tmp_path / "art").as_uri())
    parent = client.create_run(exp, run_name="s").info.run_id
    study = _study(4, pruned=2)
    studies.record(uri, parent, study, SPACE, plan("s", 6), metric="val/error_teacher", round_index=0)
    run = client.get_run(parent)
    best = studies.searched_values(SPACE, study.trials[0].params)
    assert run.data.metrics["val/error_teacher"] == pytest.approx(0.2)
    assert run.data.metrics["best.mix.sigma_range.lo"] == pytest.approx(best["mix.sigma_range"][0])
    assert run.data.metrics["best.mix.sigma_range.hi"] == pytest.approx(best["mix.sigma_range"][1])
    assert run.data.metrics["best.teacher.alpha"] == pytest.approx(best["teacher.alpha"])
    assert run.data.metrics["search.trials_pruned"] == 2 and run.data.metrics["search.trials_complete"] == 4
    assert run.data.tags["best.optuna_trial"] == "0"
    note = run.data.tags["mlflow.note.content"]
    assert "4 trained the whole budget, 2 stopped early by ASHA, 0 failed" in note
    assert "`mix.sigma_range`" in note and "cowtune promote --search s" in note
    files = {a.path for a in client.list_artifacts(parent, studies.PLOT_DIR)}
    assert files == {f"optuna/{f}" for f in ("history.png", "importances.png", "parallel_coordinates.png",
                                              "ranges.png")}
    local = client.download_artifacts(parent, "optuna/ranges.png", str(tmp_path))
    assert Image.open(local).size[0] >= 500


def test_a_grown_search_logs_its_new_best_as_the_next_step(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    parent = client.create_run(client.create_experiment("g", artifact_location=(tmp_path / "a").as_uri())).info.run_id
    study = _study(2)
    studies.record(uri, parent, study, SPACE, plan("g", 2), "val/error_teacher", 0)
    better = study.trials[0]
    study.add_trial(optuna.trial.create_trial(params=better.params, distributions=better.distributions, value=0.05))
    studies.record(uri, parent, study, SPACE, plan("g", 3), "val/error_teacher", 1)
    history = client.get_metric_history(parent, "val/error_teacher")
    assert [(m.step, round(m.value, 4)) for m in sorted(history, key=lambda m: m.step)] == [(0, 0.2), (1, 0.05)]
    assert "in 2 rounds" in client.get_run(parent).data.tags["mlflow.note.content"]


def test_too_few_trials_still_give_the_plots_that_can_be_drawn(tmp_path):
    drawn = {p.name for p in studies.plots(_study(1), SPACE, tmp_path)}
    assert "history.png" in drawn and "ranges.png" in drawn   # importances need two complete trials
    assert not (tmp_path / "importances.png").exists() or "importances.png" in drawn


def test_a_study_with_no_finished_trial_records_counts_and_no_best(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    parent = client.create_run(client.create_experiment("e", artifact_location=(tmp_path / "a").as_uri())).info.run_id
    studies.record(uri, parent, optuna.create_study(), SPACE, plan("e", 2), "val/error_teacher", 0)
    run = client.get_run(parent)
    assert run.data.metrics["search.trials_complete"] == 0 and "val/error_teacher" not in run.data.metrics
    assert "**Best**" not in run.data.tags["mlflow.note.content"]


def test_the_search_points_at_its_experiment_in_the_model_training_view():
    assert studies.ui_link("http://127.0.0.1:5000/", "3") == \
        "http://127.0.0.1:5000/#/experiments/3/runs?workflowType=machine_learning"
    assert studies.ui_link("sqlite:////tmp/x/mlflow.db", "1") == ("`mlflow ui --backend-store-uri sqlite:///mlflow.db` "
                                                                  "at http://127.0.0.1:5000/#/experiments/1/runs"
                                                                  "?workflowType=machine_learning")


@pytest.mark.slow
def test_the_link_opens_the_runs_table_in_a_new_browser(mlflow_server, tmp_path):
    """The search's last line's link, opened in a fresh headless Chromium (no stored view: the UI's default is its
    GenAI view, which the experiment's plain URL opens), shows the experiment's runs table in the model-training
    view, with the search's parent run in it."""
    import ui_screens

    ui_screens.skip_without_browser()
    client = MlflowClient(mlflow_server)
    experiment_id = client.create_experiment(f"ui-link-{tmp_path.name}")
    client.create_run(experiment_id, run_name="the-parent-run")
    with ui_screens.browser_page(mlflow_server) as page:
        ui_screens.goto(page, studies.ui_link(mlflow_server, experiment_id), tmp_path, "ui-link")
        ui_screens.wait_for_texts(page, ["Run Name", "the-parent-run", "Models"], tmp_path, "ui-link", 60,
                                  "the runs table of the model-training view")
        assert "workflowType=machine_learning" in page.url and f"/experiments/{experiment_id}/runs" in page.url
        assert "Evaluation runs" not in page.evaluate("() => document.body.innerText")   # the GenAI side bar's


def test_a_tree_copied_without_its_git_takes_its_commit_from_the_environment(tmp_path, monkeypatch):
    """A GPU machine's copy of the code has no .git: the runs' commit comes from $COWTUNE_COMMIT, not 'unknown'."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import trainables
    shutil.copytree(Path(trainables.__file__).parent, tmp_path / "trainables",
                    ignore=shutil.ignore_patterns("__pycache__"))
    ask = [sys.executable, "-c", "from trainables.search.mlflow_runs import git_sha; print(git_sha())"]
    env = {k: v for k, v in os.environ.items() if k not in ("COWTUNE_COMMIT", "PYTHONPATH", "GIT_DIR")}
    env["GIT_CEILING_DIRECTORIES"] = str(tmp_path.parent)   # no repository above the copy either
    run = lambda extra: subprocess.run(ask, cwd=tmp_path, env={**env, **extra}, capture_output=True, text=True,
                                       check=True).stdout.strip()
    assert run({}) == "unknown"
    assert run({"COWTUNE_COMMIT": "a15b306"}) == "a15b306"
    here = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=Path(trainables.__file__).parent).stdout.strip()
    from trainables.search import mlflow_runs
    monkeypatch.setenv("COWTUNE_COMMIT", "a15b306")
    assert len(here) == 40 and mlflow_runs.git_sha() == here   # in the repository itself git answers first


def test_a_store_moved_after_writing_reads_its_artifacts_beside_its_database(tmp_path):
    """An embedded store brought back from a GPU machine (its database and mlartifacts/ unpacked elsewhere) still
    names the old artifact folder; cowtune reads the artifacts beside the database, or says what is missing."""
    import shutil

    from trainables.search import mlflow_runs
    from trainables.validation import ConfigError

    there = tmp_path / "device" / "s"
    there.mkdir(parents=True)
    uri = f"sqlite:///{there / 'mlflow.db'}"
    client = MlflowClient(uri)
    run = client.create_run(mlflow_runs.ensure_experiment(uri, "moved", workdir=there))
    (tmp_path / "confirm.json").write_text('{"winner": "paper"}')
    client.log_artifact(run.info.run_id, str(tmp_path / "confirm.json"))
    here = tmp_path / "here"
    shutil.move(str(there), str(here))   # the old folder is gone, as on the GPU machine
    moved = MlflowClient(f"sqlite:///{here / 'mlflow.db'}")
    run = moved.get_run(run.info.run_id)
    assert str(there) in run.info.artifact_uri
    assert mlflow_runs.read_artifact(moved, run, "confirm.json") == '{"winner": "paper"}'
    shutil.rmtree(here / "mlartifacts")
    with pytest.raises(ConfigError, match=r"artifact 'confirm.json' is not at .*mlartifacts/ folder\? Put it beside"):
        mlflow_runs.read_artifact(moved, run, "confirm.json")
