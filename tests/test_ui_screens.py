"""The web UIs show a real search (issue 38): a smoke search recorded by a real `mlflow server` and an Optuna study in
SQLite, looked at in headless Chromium: the parent run, a trial's val/error_teacher chart, its mask gallery and
learning curve, and the study's history in optuna-dashboard. Screenshots go to artifacts/screenshots/ (or
$COWTUNE_SCREENSHOTS); a page that does not show the runs fails."""
from __future__ import annotations

import subprocess
import time
import urllib.request

import pytest

from conftest import BIN, free_port, run_search_script, stop_group
from ui_screens import (CURVE_FILE, MASKS_FILE, METRIC, MLFLOW_UI_STATE, check_png, mlflow_pages, needs_browser,
                        optuna_pages, page_shows, run_name, screenshots_dir)

pytestmark = [pytest.mark.slow, needs_browser()]
NAME = "ui-shots"


@pytest.fixture(scope="module")
def search(search_env, tmp_path_factory):
    """A two-trial smoke search whose study is in SQLite, and optuna-dashboard on that database."""
    tmp = tmp_path_factory.mktemp("ui")
    storage = f"sqlite:///{tmp / 'optuna.db'}"
    out = run_search_script("cifar10_cowmix.py", ["--smoke-test", "--trials", "2", "--concurrency", "1", "--name", NAME,
                                                  "--storage", str(tmp / "ray"), "--optuna-storage", storage,
                                                  "--no-compile-ahead"], search_env, tmp)
    assert "done: 2 trials (0 failed)" in out.stdout
    port, log = free_port(), tmp / "optuna-dashboard.log"
    proc = subprocess.Popen([str(BIN / "optuna-dashboard"), "--host", "127.0.0.1", "--port", str(port), storage],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    dashboard = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(f"{dashboard}/api/studies", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"optuna-dashboard did not start: {log.read_text()[-2000:]}")
                time.sleep(0.5)
        yield {"storage": storage, "dashboard": dashboard}
    finally:
        stop_group(proc)


def records(mlflow_uri: str, storage: str):
    import optuna
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_uri)
    exp = client.get_experiment_by_name(NAME)
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    children = sorted((r for r in runs if "mlflow.parentRunId" in r.data.tags), key=lambda r: r.info.start_time)
    study_id = optuna.storages.RDBStorage(storage).get_study_id_from_name(NAME)
    return client, exp.experiment_id, parent, children, study_id


def test_the_mlflow_ui_and_optuna_dashboard_show_the_search(search, mlflow_server):
    client, exp_id, parent, children, study_id = records(mlflow_server, search["storage"])
    assert len(children) == 2
    child = children[0]
    assert {a.path for a in client.list_artifacts(child.info.run_id)} >= {MASKS_FILE, CURVE_FILE}
    assert METRIC in child.data.metrics
    out = screenshots_dir()
    shots = mlflow_pages(mlflow_server, exp_id, parent.info.run_id, child.info.run_id, out)
    shots += optuna_pages(search["dashboard"], study_id, NAME, out, min_points=2)
    assert [p.name for p in shots] == ["mlflow-parent-run.png", "mlflow-trial-metric.png", "mlflow-trial-masks.png",
                                       "mlflow-trial-learning-curve.png", "optuna-history.png"]
    for path in shots:
        check_png(path)


def test_a_page_that_does_not_show_the_runs_fails(search, mlflow_server, tmp_path):
    _, exp_id, parent, children, study_id = records(mlflow_server, search["storage"])
    trial = run_name(mlflow_server, children[0].info.run_id)
    # MLflow's page of a run that is not there: the UI answers with its own error page, not the trial
    with pytest.raises(AssertionError, match=rf"\['{trial}'\] did not show within 2 s"):
        page_shows(f"{mlflow_server}/#/experiments/{exp_id}/runs/{'0' * 32}", [trial], tmp_path, "no-run",
                   timeout=2, local_storage=MLFLOW_UI_STATE)
    assert (tmp_path / "no-run-FAILED.png").stat().st_size > 0 and not (tmp_path / "no-run.png").exists()
    # A study the dashboard does not have, and a server that is not there
    with pytest.raises(AssertionError, match=rf"'{NAME} \(id={study_id + 1}\)'.* did not show"):
        optuna_pages(search["dashboard"], study_id + 1, NAME, tmp_path, timeout=2)
    with pytest.raises(AssertionError, match="did not load"):
        page_shows(f"http://127.0.0.1:{free_port()}/", ["anything"], tmp_path, "no-server", timeout=2)
    # A blank page shows nothing
    with pytest.raises(AssertionError, match="did not show"):
        page_shows("about:blank", [parent.info.run_name], tmp_path, "blank", timeout=1)
