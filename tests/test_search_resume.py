"""Kill the search driver mid-search (SIGKILL), run the same command again: it resumes, and every
trial ends up in MLflow exactly once, with each epoch logged exactly once. A run whose trial Ray had
not saved when the driver died (it starts that slot again under a new id) is ended as an orphan. The Optuna study
lives in PostgreSQL as on the team stack (where its server is installed, as scripts/test.sh does; else in the
default SQLite file)."""
import os
import signal
import subprocess
import sys
import time

import optuna
import pytest
from mlflow.tracking import MlflowClient

from conftest import PG_BIN, ROOT, run_search_script
from trainables.search import mlflow_runs

pytestmark = pytest.mark.slow


@pytest.fixture
def optuna_storage(request, tmp_path) -> str | None:
    """The study's database: a fresh PostgreSQL one (the team stack's), or None (STORAGE/NAME.optuna.db)."""
    return request.getfixturevalue("postgres")(f"resume_{tmp_path.name[-8:].lower()}") if PG_BIN else None


def test_killed_driver_resumes_without_losing_or_duplicating_trials(search_env, mlflow_server, optuna_storage,
                                                                    tmp_path):
    if optuna_storage:
        search_env = {**search_env, "COWTUNE_OPTUNA_STORAGE": optuna_storage}
    args = ["--smoke-test", "--trials", "4", "--epochs", "3", "--set", "train.steps_per_epoch=12", "--no-confirm",
            "--name", "resume", "--storage", str(tmp_path / "ray")]
    client = MlflowClient(mlflow_server)
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(ROOT / "search_spaces" / "cifar10_cowmix.py"), *args],
                                env=search_env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            exp = client.get_experiment_by_name("resume")
            runs = client.search_runs([exp.experiment_id]) if exp else []
            children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
            if len(children) >= 2 and any("epoch" in r.data.metrics for r in children):
                break
            time.sleep(0.3)
        else:
            proc.kill()
            pytest.fail("no trial reported an epoch before the search ended or 240 s passed: "
                        + (tmp_path / "first.log").read_text()[-2000:])
        assert proc.poll() is None, "the search finished before it could be killed: " + (tmp_path / "first.log").read_text()[-2000:]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    before = [r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
    assert len(before) < 4 or any(r.info.status == "RUNNING" for r in before)      # killed mid-search
    # What a trial started after Ray's last experiment snapshot leaves behind: a run Ray does not know.
    parent = next(r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" not in r.data.tags)
    unsaved = client.create_run(exp.experiment_id, run_name="unsaved",
                                tags={"mlflow.parentRunId": parent.info.run_id, "ray.trial_id": "unsaved0"}).info.run_id

    out = run_search_script("cifar10_cowmix.py", args, search_env, tmp_path)
    assert "[resuming]" in out.stdout and "done: 4 trials (0 failed)" in out.stdout
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    orphans = [r for r in runs if "cowtune.orphaned" in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags and "cowtune.orphaned" not in r.data.tags]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert unsaved in {o.info.run_id for o in orphans} and f"MLflow run {unsaved} (trial unsaved0)" in out.stdout
    assert all(o.info.status == "KILLED" and "mlflow.parentRunId" in o.data.tags for o in orphans)
    assert {c.info.run_id for c in mlflow_runs.child_runs(mlflow_server, exp.experiment_id, parent.info.run_id)} \
        == {c.info.run_id for c in children}                                   # what promote ranks
    assert len(children) == 4 and len({c.data.tags["ray.trial_id"] for c in children}) == 4
    for c in children:
        assert c.info.status == "FINISHED"
        steps = [m.step for m in client.get_metric_history(c.info.run_id, "val/error_teacher")]
        assert sorted(steps) == [1, 2, 3], (c.info.run_name, steps)       # nothing lost, nothing logged twice
    # The Optuna study: each trial once, with its final error
    if optuna_storage:
        assert "Optuna study postgresql+psycopg2://cowtune:***@127.0.0.1" in out.stdout
    study = optuna.load_study(study_name="resume",
                              storage=optuna_storage or f"sqlite:///{tmp_path / 'ray' / 'resume.optuna.db'}")
    objective = "val/error_teacher_mean3"   # what the search file ranks by: what Optuna is told
    histories = [{m.step: m.value for m in client.get_metric_history(c.info.run_id, objective)} for c in children]
    done = [t for t in study.trials if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)]
    orphans = [t for t in study.trials if t not in done]   # asked before the kill in a trial Ray had not saved
    assert len(done) == 4 and all(t.state == optuna.trial.TrialState.FAIL and "cowtune.orphaned" in t.user_attrs
                                  for t in orphans), [(t.number, t.state) for t in study.trials]
    assert all(f"Optuna trial {t.number}: asked before the driver died" in out.stdout for t in orphans)
    assert sorted(sorted(t.intermediate_values.items()) for t in done) == \
        sorted(sorted(h.items()) for h in histories)          # every epoch of every trial, those after the restore too
    assert sorted(t.value for t in done if t.value is not None) == \
        sorted(h[max(h)] for h in histories if max(h) == 3)   # the finished trials' final errors


def test_a_killed_trial_worker_is_retried_from_its_checkpoint_to_the_undisturbed_result(search_env, mlflow_server,
                                                                                         tmp_path):
    """The trial's Ray worker process is SIGKILLed mid-run: Ray retries the trial from its last checkpoint on a new
    worker, the trial ends with the metrics of an undisturbed run of the same search (exact resume), and its
    MLflow run holds each epoch's metrics exactly once."""
    common = ["--smoke-test", "--trials", "1", "--epochs", "5", "--set", "train.steps_per_epoch=40",
              "--no-compile-ahead"]
    client = MlflowClient(mlflow_server)
    killed_pid = None
    script = str(ROOT / "search_spaces" / "cifar10_cowmix.py")
    with open(tmp_path / "ref.log", "w") as ref_log:   # the undisturbed reference, meanwhile (the same seed)
        ref = subprocess.Popen([sys.executable, script, *common, "--name", "wref", "--storage", str(tmp_path / "ray")],
                               env=search_env, cwd=tmp_path, stdout=ref_log, stderr=subprocess.STDOUT)
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(ROOT / "search_spaces" / "cifar10_cowmix.py"), *common,
                                 "--name", "wkill", "--storage", str(tmp_path / "ray")],
                                env=search_env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None and killed_pid is None:
            exp = client.get_experiment_by_name("wkill")
            runs = client.search_runs([exp.experiment_id]) if exp else []
            child = next((r for r in runs if "mlflow.parentRunId" in r.data.tags), None)
            if child and "worker.pid" in child.data.tags and \
                    len(client.get_metric_history(child.info.run_id, "epoch")) >= 2:
                killed_pid = int(child.data.tags["worker.pid"])
                os.kill(killed_pid, signal.SIGKILL)          # mid-epoch 3: its checkpoint is epoch 2's
            time.sleep(0.2)
        try:
            assert killed_pid is not None, "no epoch 2 before the search ended: " + (tmp_path / "killed.log").read_text()[-2000:]
            assert proc.wait(300) == 0, (tmp_path / "killed.log").read_text()[-3000:]
            assert ref.wait(300) == 0, (tmp_path / "ref.log").read_text()[-3000:]
        finally:
            proc.kill()
            ref.kill()
    out = (tmp_path / "killed.log").read_text()
    assert "done: 1 trials (0 failed)" in out and "Ray runs it again" in out    # the progress table said so

    def trial(name: str):
        exp = client.get_experiment_by_name(name)
        (child,) = [r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
        return child, client.get_metric_history(child.info.run_id, "val/error_teacher")

    killed, killed_history = trial("wkill")
    reference, reference_history = trial("wref")
    assert killed.info.status == "FINISHED"
    assert int(killed.data.tags["worker.pid"]) != killed_pid                        # a new worker finished it
    assert sorted(m.step for m in killed_history) == [1, 2, 3, 4, 5]              # each epoch exactly once
    assert sorted((m.step, m.value) for m in killed_history) == sorted((m.step, m.value) for m in reference_history)
    for key in ("val/error_teacher", "val/error_student", "val/loss_teacher", "train/loss_sup", "train/loss_mix"):
        assert killed.data.metrics[key] == reference.data.metrics[key], key      # the last epoch's, bit for bit
