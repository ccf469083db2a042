"""The MLflow server goes away during a trial and comes back, or never does: nothing is lost, training never waits.

A real ``mlflow server`` process is stopped (SIGTERM) and started again on the same store and port; the trial's run
is fed through ``TrialRun`` exactly as a Ray trial feeds it.
"""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
from mlflow.tracking import MlflowClient

from conftest import ROOT, free_port, start_mlflow_server, stop_group
from trainables.search import mlflow_runs
from trainables.search.mlflow_runs import TrialRun, ensure_experiment

pytestmark = pytest.mark.slow


def test_records_wait_while_the_server_is_away_and_arrive_in_order(tmp_path, monkeypatch):
    monkeypatch.setenv("COWTUNE_OUTBOX", str(tmp_path / "kept"))
    monkeypatch.setattr(mlflow_runs, "RETRY_S", 0.0)   # try again at every record (a trial: at most every 15 s)
    store, port = tmp_path / "server", free_port()
    store.mkdir()
    uri = f"http://127.0.0.1:{port}"
    server = start_mlflow_server(store, port)
    try:
        experiment = ensure_experiment(uri, "outage")
        parent = MlflowClient(uri).create_run(experiment).info.run_id
        said: list[str] = []
        trial = tmp_path / "trial"
        trial.mkdir()
        run = TrialRun(uri, experiment, parent, "t0", "trial_t0", trial, {"seed": 0}, {}, log=said.append)
        run.log_epoch(1, {"val/error_teacher": 0.9, "epoch": 1})

        stop_group(server)                                   # the server goes away mid-trial
        t0 = time.monotonic()
        for epoch in (2, 3):
            run.log_epoch(epoch, {"val/error_teacher": 1 - epoch / 10, "epoch": epoch})
        (trial / "curve.png").write_bytes(b"png")
        run.log_artifact(trial / "curve.png")
        (trial / "curve.png").write_bytes(b"changed after it was logged")
        assert time.monotonic() - t0 < 60                    # training waited seconds, not MLflow's minutes of retries
        assert len(run.outbox.pending) == 3 and (trial / mlflow_runs.OUTBOX).exists()
        assert sum("does not answer" in s for s in said) == 1    # said once, not at every record

        server = start_mlflow_server(store, port)             # it comes back: the next record delivers them all
        run.log_epoch(4, {"val/error_teacher": 0.6, "epoch": 4})
        client = MlflowClient(uri)
        history = client.get_metric_history(run.run_id, "val/error_teacher")
        assert [m.step for m in sorted(history, key=lambda m: m.timestamp)] == [1, 2, 3, 4]   # once each, in order
        assert [m.value for m in sorted(history, key=lambda m: m.step)] == [0.9, 0.8, 0.7, 0.6]
        local = client.download_artifacts(run.run_id, "curve.png", str(tmp_path / "got"))
        assert open(local, "rb").read() == b"png"            # the file as it was when logged
        assert not run.outbox.pending and not (trial / mlflow_runs.OUTBOX).exists()
        assert any("answers again" in s for s in said)

        stop_group(server)                                   # away again, and the trial ends before it returns
        run.log_epoch(5, {"val/error_teacher": 0.5, "epoch": 5})
        kept = run.finish("FINISHED")
        assert kept is not None and kept.parent == tmp_path / "kept" and (kept / mlflow_runs.OUTBOX).exists()
        assert f"run `cowtune upload {kept.parent}` there" in said[-1]

        cmd = [sys.executable, "-m", "trainables.cli", "upload", str(kept.parent)]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
        still = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert still.returncode == 1 and "0 trial runs delivered; 1 still wait" in still.stdout, still.stdout
        assert (kept / mlflow_runs.OUTBOX).exists()               # nothing dropped while it is still away

        server = start_mlflow_server(store, port)
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "1 trial runs delivered" in done.stdout, done.stdout + done.stderr
        assert not kept.exists()
        final = client.get_run(run.run_id)
        assert final.info.status == "FINISHED"
        assert sorted(m.step for m in client.get_metric_history(run.run_id, "val/error_teacher")) == [1, 2, 3, 4, 5]
    finally:
        stop_group(server)


def test_a_search_trains_on_while_mlflow_is_away_and_records_every_epoch_once(search_env, tmp_path):
    """The tracking server of a running search stops after the trial's first epoch and starts again a while later:
    the trial never fails or waits for it, and its run ends with every epoch, once, in order."""
    store, port = tmp_path / "server", free_port()
    store.mkdir()
    uri = f"http://127.0.0.1:{port}"
    server = start_mlflow_server(store, port)
    env = {**search_env, "MLFLOW_TRACKING_URI": uri}
    args = ["--smoke-test", "--trials", "1", "--epochs", "8", "--set", "train.steps_per_epoch=60", "--no-compile-ahead",
            "--no-confirm", "--name", "away", "--storage", str(tmp_path / "ray")]
    client = MlflowClient(uri)
    try:
        with open(tmp_path / "search.log", "w") as log:
            proc = subprocess.Popen([sys.executable, str(ROOT / "search_spaces" / "cifar10_cowmix.py"), *args],
                                    env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
            try:
                deadline, child = time.time() + 240, None
                while time.time() < deadline and proc.poll() is None:
                    exp = client.get_experiment_by_name("away")
                    runs = client.search_runs([exp.experiment_id]) if exp else []
                    child = next((r for r in runs if "mlflow.parentRunId" in r.data.tags), None)
                    if child and client.get_metric_history(child.info.run_id, "epoch"):
                        break
                    time.sleep(0.2)
                assert proc.poll() is None and child is not None, (tmp_path / "search.log").read_text()[-3000:]
                stop_group(server)                       # away from epoch 1 or 2 on
                time.sleep(8)
                server = start_mlflow_server(store, port)
                assert proc.wait(300) == 0, (tmp_path / "search.log").read_text()[-3000:]
            finally:
                proc.kill()
        out = (tmp_path / "search.log").read_text()
        assert "done: 1 trials (0 failed)" in out and "does not answer" in out and "answers again" in out, out[-3000:]
        run = client.get_run(child.info.run_id)
        assert run.info.status == "FINISHED"
        history = client.get_metric_history(child.info.run_id, "val/error_teacher")
        assert [m.step for m in sorted(history, key=lambda m: m.timestamp)] == list(range(1, 9))
    finally:
        stop_group(server)
