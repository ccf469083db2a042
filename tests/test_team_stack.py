"""The team stack of docker-compose.yml, run for real as processes on loopback (no Docker engine here): PostgreSQL
holding MLflow's store and the Optuna study, an MLflow server on it with proxied artifacts, a Ray head that runs
no trials and a second Ray node that runs them, and optuna-dashboard on the same database. A search runs through
it, is checked with the MLflow and Optuna clients and the dashboard's API, then grows with a larger --trials; both
web UIs are then looked at in headless Chromium (tests/ui_screens.py), screenshots in artifacts/screenshots/."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import (BIN, PG_BIN, free_port, run_search_script, start_ray_node, stop_group,
                      mlflow_server_env, wait_ray, wait_until)
from ui_screens import (MLFLOW_UI_STATE, check_png, mlflow_pages, needs_browser, optuna_pages, page_shows,
                        screenshots_dir)

pytestmark = pytest.mark.skipif(PG_BIN is None, reason="PostgreSQL's server is not installed (scripts/test.sh does)")
NAME = "team-smoke"


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def stack(tmp_path_factory, ray_token_env, postgres):
    import optuna

    tmp = tmp_path_factory.mktemp("team")
    procs = []
    mlflow_db, optuna_db = postgres("mlflow"), postgres("optuna")
    try:
        port, log = free_port(), tmp / "mlflow.log"
        procs.append(subprocess.Popen(
            [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
             "--backend-store-uri", mlflow_db, "--serve-artifacts", "--artifacts-destination",
             str(tmp / "mlartifacts")], stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
            env=mlflow_server_env()))
        mlflow_uri = f"http://127.0.0.1:{port}"
        head_port, dash_port = free_port(), free_port()
        ray_temp = Path(f"/tmp/cowtune-ray-{head_port}")
        procs.append(start_ray_node(tmp, ray_token_env, num_cpus=0, extra=(
            "--head", f"--port={head_port}", "--include-dashboard=false", f"--temp-dir={ray_temp}")))
        procs.append(start_ray_node(tmp, ray_token_env, head_port=head_port, num_cpus=2))
        # optuna-dashboard opens the storage without creating Optuna's tables: they are made first (the compose
        # file's dashboard does the same before it starts)
        optuna.storages.RDBStorage(optuna_db)
        dash_log = tmp / "optuna-dashboard.log"
        procs.append(subprocess.Popen([str(BIN / "optuna-dashboard"), "--host", "127.0.0.1", "--port", str(dash_port),
                                       optuna_db], stdout=open(dash_log, "w"), stderr=subprocess.STDOUT,
                                      start_new_session=True))
        wait_until("mlflow server", lambda: _answers(f"{mlflow_uri}/health"), procs[0], log)
        wait_until("optuna-dashboard", lambda: _answers(f"http://127.0.0.1:{dash_port}/api/studies"), procs[3],
                   dash_log)
        wait_ray(f"127.0.0.1:{head_port}", 2, ray_token_env)
        env = {**os.environ, **ray_token_env, "MLFLOW_TRACKING_URI": mlflow_uri, "RAY_ADDRESS": f"127.0.0.1:{head_port}",
               "COWTUNE_OPTUNA_STORAGE": optuna_db, "PYTHONUNBUFFERED": "1",
               "COWTUNE_CACHE": str(tmp / "cache")}
        yield {"env": env, "tmp": tmp, "mlflow": mlflow_uri, "optuna": optuna_db,
               "dashboard": f"http://127.0.0.1:{dash_port}", "storage": tmp / "ray_results"}
    finally:
        for proc in reversed(procs):
            stop_group(proc, timeout=10)


def _search(stack: dict, trials: int) -> subprocess.CompletedProcess:
    return run_search_script("cifar10_cowmix.py", ["--smoke-test", "--trials", str(trials), "--no-confirm", "--name", NAME,
                                                   "--storage", str(stack["storage"]), "--no-compile-ahead"],
                             stack["env"], stack["tmp"])


def _records(stack: dict) -> tuple:
    import optuna
    from mlflow.tracking import MlflowClient

    client = MlflowClient(stack["mlflow"])
    exp = client.get_experiment_by_name(NAME)
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    study = optuna.load_study(study_name=NAME, storage=stack["optuna"])
    return client, parents, children, study


@pytest.fixture(scope="module")
def first(stack):
    return _search(stack, 2)


def test_a_search_on_the_stack_records_into_postgres_mlflow_and_the_optuna_study(stack, first):
    assert "Optuna study postgresql+psycopg2://cowtune:***@127.0.0.1" in first.stdout   # never the password
    assert "done: 2 trials (0 failed)" in first.stdout
    client, parents, children, study = _records(stack)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED" and len(children) == 2
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
    # Every trial is in the study, told with the error the trial's MLflow run ended on.
    assert len(study.trials) == 2 and all(t.state.name in ("COMPLETE", "PRUNED") for t in study.trials)
    finals = sorted(c.data.metrics["val/error_teacher_mean3"] for c in children)
    told = sorted(t.value if t.value is not None else t.intermediate_values[max(t.intermediate_values)]
                  for t in study.trials)
    assert told == pytest.approx(finals)
    # Artifacts go through the server's proxy (mlflow-artifacts:/), stored in its own folder.
    artifacts = client.list_artifacts(children[0].info.run_id)
    assert artifacts and children[0].info.artifact_uri.startswith("mlflow-artifacts:")
    assert any((stack["tmp"] / "mlartifacts").rglob(artifacts[0].path.split("/")[-1]))


def test_trials_ran_on_the_second_node_as_the_head_has_no_cpus(stack, first):
    # As the compose file's head, this one schedules no trials (no CPUs, no GPUs): each trial needs a CPU, which only
    # the second node has, so the two finished trials ran there.
    code = ("import json, ray; ray.init(logging_level='ERROR'); "
            "print(json.dumps(sorted(n['Resources'].get('CPU', 0) for n in ray.nodes() if n['Alive'])))")
    out = subprocess.run([sys.executable, "-c", code], env=stack["env"], capture_output=True, text=True, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [0, 2], out.stderr[-2000:]
    assert len(list((stack["storage"] / NAME).glob("*/result.json"))) == 2


def test_optuna_dashboard_serves_the_study_from_the_same_database(stack, first):
    studies = json.load(urllib.request.urlopen(f"{stack['dashboard']}/api/studies", timeout=10))["study_summaries"]
    mine = [s for s in studies if s["study_name"] == NAME]
    assert len(mine) == 1
    detail = json.load(urllib.request.urlopen(f"{stack['dashboard']}/api/studies/{mine[0]['study_id']}?after=0",
                                              timeout=10))
    assert len(detail["trials"]) == 2


def test_the_same_search_with_more_trials_grows_the_study_under_the_same_parent_run(stack, first):
    out = _search(stack, 3)
    assert "round 2: 1 trials after its 2" in out.stdout and "done: 1 trials (0 failed)" in out.stdout
    client, parents, children, study = _records(stack)
    assert len(parents) == 1 and len(children) == 3 and len(study.trials) == 3
    assert parents[0].data.tags["cowtune.rounds_done"] == "2" and parents[0].data.tags["cowtune.trials"] == "3"
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
    assert (stack["storage"] / f"{NAME}-more1").is_dir()
    # The parent run says how the search went (trainables/search/studies.py), updated by the second round
    best = parents[0].data
    assert best.metrics["search.trials_complete"] + best.metrics["search.trials_pruned"] == 3
    assert best.metrics["val/error_teacher_mean3"] == pytest.approx(study.best_value)   # the search file's objective
    assert best.tags["best.optuna_trial"] == str(study.best_trial.number) and "in 2 rounds" in best.tags["mlflow.note.content"]
    assert {a.path for a in client.list_artifacts(parents[0].info.run_id, "optuna")} >= {"optuna/history.png",
                                                                                        "optuna/ranges.png"}
    # Run again as it is: nothing to add; it reports the finished round and starts no trial.
    again = _search(stack, 3)
    assert "[resuming]" in again.stdout
    assert len(_records(stack)[2]) == 3


@needs_browser()
def test_the_mlflow_ui_and_optuna_dashboard_of_the_stack_show_the_search(stack, first):
    # After the growth test: the parent run holds both rounds' trials. Screenshots: artifacts/screenshots/team-*.png
    # (README, Team stack); each page must show the runs (names, chart legend, loaded images, plotted trials).
    client, parents, children, study = _records(stack)
    child = min(children, key=lambda c: c.info.start_time)
    out = screenshots_dir()
    shots = mlflow_pages(stack["mlflow"], parents[0].info.experiment_id, parents[0].info.run_id, child.info.run_id,
                         out, prefix="team-", parent_texts=("stopped early by ASHA", "best.teacher.alpha"))
    shots += optuna_pages(stack["dashboard"], study._study_id, NAME, out, prefix="team-", min_points=len(study.trials))
    assert [p.name for p in shots] == ["team-mlflow-parent-run.png", "team-mlflow-trial-metric.png",
                                       "team-mlflow-trial-masks.png", "team-mlflow-trial-learning-curve.png",
                                       "team-optuna-history.png"]
    for path in shots:
        check_png(path)


@needs_browser()
def test_a_page_that_does_not_show_the_runs_fails(stack, first, tmp_path):
    client, parents, children, study = _records(stack)
    exp_id, trial = parents[0].info.experiment_id, children[0].info.run_name
    # MLflow's page of a run that is not there: the UI answers with its own error page, not the trial
    with pytest.raises(AssertionError, match=rf"\['{trial}'\] did not show within 2 s"):
        page_shows(f"{stack['mlflow']}/#/experiments/{exp_id}/runs/{'0' * 32}", [trial], tmp_path, "no-run",
                   timeout=2, local_storage=MLFLOW_UI_STATE)
    assert (tmp_path / "no-run-FAILED.png").stat().st_size > 0 and not (tmp_path / "no-run.png").exists()
    # A study the dashboard does not have, a server that is not there, a blank page
    with pytest.raises(AssertionError, match=rf"'{NAME} \(id={study._study_id + 1}\)'.* did not show"):
        optuna_pages(stack["dashboard"], study._study_id + 1, NAME, tmp_path, timeout=2)
    with pytest.raises(AssertionError, match="did not load"):
        page_shows(f"http://127.0.0.1:{free_port()}/", ["anything"], tmp_path, "no-server", timeout=2)
    with pytest.raises(AssertionError, match="did not show"):
        page_shows("about:blank", [parents[0].info.run_name], tmp_path, "blank", timeout=1)
