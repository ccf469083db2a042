"""The search's compact progress table (trainables/search/progress.py): its formatting on synthetic trials, its
throttling, what it quietens and puts back, the --ray-output flag; and a real smoke search with Ray Tune's own
output (the table's own real search is test_search.py's: test_the_search_prints_a_short_table)."""
import logging
import os
import pickle
import re
import subprocess
import sys
import types

import pytest

from conftest import BOX, run_search_script, without_engine_env
from trainables import metrics as M
from trainables.search import progress
from trainables.search.intervals import Float
from trainables.search.plan import SearchSettings, parse_args

PARAMS = ["mix.sigma_range", "mix.weight", "teacher.alpha"]
ERR = M.VAL_ERROR_TEACHER


class FakeTrial:
    def __init__(self, trial_id, sigma=(4.0, 16.0), weight=30.0, alpha=0.97, status="PENDING"):
        self.trial_id, self.status = trial_id, status
        self.config = {"mix": {"sigma_range": list(sigma), "weight": weight}, "teacher": {"alpha": alpha}, "seed": 0}
        self.last_result, self.metric_analysis, self.error_file = {}, {}, None


@pytest.fixture(autouse=True)
def engine_env(monkeypatch):
    """RAY_AIR_NEW_OUTPUT unset in each test and put back after it, also when a test fails midway (the session's
    search_env copies this process's environment into the searches it runs)."""
    monkeypatch.setenv(progress.ENGINE_ENV, "1")
    monkeypatch.delenv(progress.ENGINE_ENV)
    yield
    progress.restore_engine()


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(progress.time, "monotonic", c)
    return c


@pytest.fixture
def cb(clock, capsys):
    p = progress.SearchProgress("demo", ERR, "min", 4, PARAMS, interval_s=30)
    p.setup(total_num_samples=5)
    assert capsys.readouterr().out.startswith("demo: a progress table every 30 s and when a trial ends")
    yield p
    p.on_experiment_end(trials=[])        # puts back what setup quietened
    capsys.readouterr()


def report(cb, trials, trial, epoch, err):
    trial.status = "RUNNING"
    cb.on_trial_result(0, trials, trial, {ERR: err, M.EPOCH: epoch})
    trial.last_result = {ERR: err, M.EPOCH: epoch}


def aligned(header, row, right=(2, 3, 4)):
    """Each cell of ``row`` starts (left-aligned columns) or ends (right-aligned) where its header does."""
    spans = [[(m.start(), m.end()) for m in re.finditer(r"\S+", line)] for line in (header, row)]
    return len(spans[0]) == len(spans[1]) and all(
        (h[1] == r[1]) if i in right else (h[0] == r[0]) for i, (h, r) in enumerate(zip(*spans)))


def test_table_counts_states_rows_and_best(cb, clock, capsys, tmp_path):
    a, b, c, d = FakeTrial("aaaa0001"), FakeTrial("bbbb0002", (2.5, 21.6), 7.04, 0.943), FakeTrial("cccc0003"), \
        FakeTrial("dddd0004")
    trials = [a, b, c, d]
    for e, err in ((1, 0.5), (2, 0.4), (3, 0.45)):
        report(cb, trials, a, e, err)
    report(cb, trials, b, 1, 0.6)
    report(cb, trials, c, 1, 0.9)
    clock.t += 75
    cb.on_trial_complete(0, trials, b)                   # ASHA stopped it at epoch 1 of 4: pruned
    b.status = "TERMINATED"
    error = tmp_path / "error.txt"
    error.write_text("Failure # 1 (occurred at 2026-11-29_11-23-41)\nray::ImplicitFunc.train()\n  File x\n"
                     "trainables.validation.TrainingDiverged: the training loss became nan in epoch 2\n\n")
    c.error_file, c.num_failures, c.path = str(error), 1, "/results/demo/train_trial_cccc0003"
    cb.on_trial_recover(0, trials, c)
    c.num_failures = 2
    cb.on_trial_recover(0, trials, c)                    # one note per trial: the latest
    c.status = "ERROR"
    cb.on_trial_error(0, trials, c)
    out = capsys.readouterr().out.splitlines()
    heads = [i for i, line in enumerate(out) if line.startswith("[")]
    assert len(heads) == 2                               # one table as each trial ended
    first, second = out[:heads[1]], out[heads[1]:]
    assert first[0] == "[0:01:15] demo: 5 trials: 2 running, 0 terminated, 1 pruned, 0 errored, 2 pending"
    assert [line.split()[:2] for line in first[2:-1]] == [["aaaa0001", "running"], ["cccc0003", "running"],
                                                          ["bbbb0002", "pruned"]]   # running, then ended
    assert first[4].split() == ["bbbb0002", "pruned", "1/4", "0.6000", "0.6000", "2.5..21.6", "7.04", "0.943"]
    assert second[0] == "[0:01:15] demo: 5 trials: 1 running, 0 terminated, 1 pruned, 1 errored, 2 pending"
    assert second[1].split() == ["trial", "state", "epoch", "last", "best", "sigma_range", "weight", "alpha"]
    assert second[2].split() == ["aaaa0001", "running", "3/4", "0.4500", "0.4000", "4..16", "30", "0.97"]
    assert second[3].split()[:5] == ["cccc0003", "errored", "1/4", "0.9000", "0.9000"]   # just ended, then the rest
    assert second[4].split()[:2] == ["bbbb0002", "pruned"]   # finished before: kept (d: counted, pending)
    assert second[5] == ("  cccc0003 errored after 1 epochs: trainables.validation.TrainingDiverged: the training "
                         "loss became nan in epoch 2 (traceback: /results/demo/train_trial_cccc0003/error.txt)")
    assert all(aligned(t[1], row) for t in (first, second) for row in t[2:-1] if "errored after" not in row)
    assert progress.error_line(types.SimpleNamespace(error_file=None)) == "no error file"
    # best so far by the last result (as the driver's "best trial"), not by the best epoch
    assert second[6] == ("  best so far: aaaa0001 val/error_teacher 0.4500 at epoch 3 "
                         "(sigma_range=4..16 weight=30 alpha=0.97)")
    assert len(second) == 7 and not BOX & set("".join(out))
    assert all(len(line) < 130 for line in out if "traceback:" not in line)   # a note names its file


def test_an_ended_trial_stays_in_the_table_with_its_state(cb, clock, capsys):
    """Issue 54 item 11: finished trials are not dropped; they follow the running ones, best first."""
    a, b = FakeTrial("aaaa0001"), FakeTrial("bbbb0002")
    report(cb, [a, b], a, 4, 0.3)
    cb.on_trial_complete(0, [a, b], a)                   # full budget: terminated
    first = capsys.readouterr().out.splitlines()
    assert first[0].endswith("0 running, 1 terminated, 0 pruned, 0 errored, 4 pending")
    assert first[2].split()[:3] == ["aaaa0001", "terminated", "4/4"]
    a.status = "TERMINATED"
    report(cb, [a, b], b, 1, 0.7)
    clock.t += 31
    cb.on_step_end(0, [a, b])
    second = capsys.readouterr().out.splitlines()
    assert [line.split()[:3] for line in second[2:-1]] == [["bbbb0002", "running", "1/4"],
                                                           ["aaaa0001", "terminated", "4/4"]]
    assert second[-1].startswith("  best so far: aaaa0001 val/error_teacher 0.3000 at epoch 4")


def test_tables_are_throttled(cb, clock, capsys):
    a = FakeTrial("aaaa0001")
    report(cb, [a], a, 1, 0.5)
    clock.t += 29
    cb.on_step_end(0, [a])
    assert capsys.readouterr().out == ""                 # within the interval
    clock.t += 1
    cb.on_step_end(0, [a])
    assert "aaaa0001  running" in capsys.readouterr().out
    clock.t += 60
    cb.on_step_end(0, [a])
    assert capsys.readouterr().out == ""                 # nothing new: no table
    clock.t += 300
    cb.on_step_end(0, [a])
    assert "aaaa0001  running" in capsys.readouterr().out   # but a heartbeat every 10 intervals


def test_restored_trials_come_from_tunes_record_and_the_summary(cb, capsys):
    old = FakeTrial("0ld00001", status="TERMINATED")       # finished before the driver restarted: never seen
    old.last_result = {ERR: 0.35, M.EPOCH: 2}
    old.metric_analysis = {ERR: {"last": 0.35, "min": 0.3, "max": 0.6}}
    new = FakeTrial("aaaa0001")
    report(cb, [old, new], new, 4, 0.4)
    cb.on_trial_complete(0, [old, new], new)
    new.status = "TERMINATED"
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("0 running, 1 terminated, 1 pruned, 0 errored, 3 pending")
    assert out[-1].startswith("  best so far: 0ld00001 val/error_teacher 0.3500 at epoch 2")
    cb.on_experiment_end([old, new])
    assert capsys.readouterr().out.strip() == (
        "search demo stopped with 3 trials unfinished after 0:00:00: 1 terminated, 1 pruned by ASHA, 0 errored; "
        "best val/error_teacher 0.3500 (trial 0ld00001, epoch 2)")


def test_tied_trials_rank_by_the_order_they_were_made_in_any_order_given(capsys):
    """Two trials of the same last error: the one Tune's searcher made first is the best, in the table and its best
    line, however Tune lists them (a restored search may list them in another order). Ray's own Trial objects."""
    from ray.tune.experiment import Trial

    def trials():
        made = [Trial("train_trial", config={"mix": {"weight": w}}, trial_id=i, experiment_tag=f"{n}_w={w}", stub=True)
                for n, i, w in ((1, "ffff0001", 30.0), (2, "0000aaaa", 7.0), (3, "bbbb0003", 9.0))]
        for t, err in zip(made, (0.25, 0.25, 0.5)):
            t.status = "TERMINATED"
            t.update_last_result({ERR: err, M.EPOCH: 4})
            t.run_metadata.metric_analysis = {ERR: {"last": err, "min": err, "max": err}}   # as Tune restores it
        return made

    for order in ((0, 1, 2), (2, 1, 0), (1, 2, 0)):
        p = progress.SearchProgress("demo", ERR, "min", 4, ["mix.weight"])
        listed = [trials()[i] for i in order]
        assert progress.trial_number(p._best(listed)) == 1 and p._best(listed).trial_id == "ffff0001"
        rows = [line.split()[0] for line in p.table(listed)[2:-1]]
        assert rows == ["ffff0001", "0000aaaa", "bbbb0003"], order
    assert progress.trial_number(FakeTrial("x")) == 1 << 30   # no tag: after every trial that has one


@pytest.mark.slow
def test_the_driver_breaks_ties_alike_on_a_first_run_and_a_restored_one(tmp_path):
    """best_result on a real Ray Tune experiment of three trials, the first two tied: the first on the ResultGrid
    of fit() and on that of Tuner.restore() (which lists the trials as it loads them)."""
    script = f"""
import ray
from ray import tune
from trainables.search.progress import best_result, trial_number
ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=1)
def trial(config):
    tune.report({{"err": config["err"]}})
tuner = tune.Tuner(trial, param_space={{"err": tune.grid_search([0.25, 0.25, 0.5])}},
                   run_config=tune.RunConfig(name="ties", storage_path={str(tmp_path)!r}, verbose=0))
first = tuner.fit()
again = tune.Tuner.restore({str(tmp_path / "ties")!r}, trainable=trial).get_results()
for grid in (first, again):
    best = best_result(grid, "err", "min")
    print("BEST", trial_number(best.metrics), best.metrics["err"])
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "RAY_AIR_NEW_OUTPUT": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert [line for line in out.stdout.splitlines() if line.startswith("BEST")] == ["BEST 0 0.25", "BEST 0 0.25"]   # grid search counts from 0


def test_formatting_helpers():
    assert progress.short_names(["mix.weight", "perturb.weight", "teacher.alpha"]) == {
        "mix.weight": "mix.weight", "perturb.weight": "perturb.weight", "teacher.alpha": "alpha"}
    assert [progress.fmt_value(v) for v in (0.123456, [1.3799, 31.62], True, "cowmix", 3)] == \
        ["0.123", "1.38..31.6", "True", "cowmix", "3"]
    assert progress.fmt_time(3725.9) == "1:02:05"
    assert progress.lookup({"a": {"b": 2}}, "a.b") == 2 and progress.lookup({"a": 1}, "a.b") is None


def test_quietens_trial_lines_and_ray_notes_and_puts_them_back(monkeypatch, capsys):
    from ray._private import ray_logging

    monkeypatch.setenv(progress.MLFLOW_URL_ENV, "0")
    monkeypatch.setattr(ray_logging.stdout_deduplicator, "skip_re", re.compile("^user pattern"))
    monkeypatch.setattr(ray_logging.stderr_deduplicator, "skip_re", None)
    p = progress.SearchProgress("demo", ERR, "min", 2, PARAMS)
    p.setup(total_num_samples=1)
    assert os.environ[progress.MLFLOW_URL_ENV] == "true"    # the driver's links to each trial's run
    skipped = ["[train_trial_b32467a5] epoch 1/2 | sup 2.347 | val err teacher 89.50%",
               "[train_trial_b32467a5]   epoch 3 step 40/390 | 2.1 steps/s | epoch ETA 2m10s",
               "[train_trial_b32467a5] data: digits: train 1797 (val 200, labeled 50, unlabeled 1597)",
               "[train_trial_b32467a5] model cnn_tiny (94,762 parameters), method cowmix, device cpu",
               "[train_trial_b32467a5]   first step 0.1 s",
               "[train_trial_a1b2c_00003] epoch 2/2 | sup 2.305",
               "Checkpoint successfully created at: Checkpoint(filesystem=local, path=/tmp/x/checkpoint_000000)",
               "\U0001f3c3 View run train_trial_59f7797c at: http://127.0.0.1:4/#/experiments/1/runs/d8cf2fb6",
               "\U0001f9ea View experiment at: http://127.0.0.1:4/#/experiments/1"]
    kept = ["Traceback (most recent call last):", "[train_trial_b32467a5] resumed from /x at epoch 3",
            "UserWarning: something", "epoch 1/2 printed by a user's own code"]
    for dedup in (ray_logging.stdout_deduplicator, ray_logging.stderr_deduplicator):
        assert all(dedup.skip_re.search(line) for line in skipped)
        assert not any(dedup.skip_re.search(line) for line in kept)
    assert ray_logging.stdout_deduplicator.skip_re.search("user pattern kept")
    batch = {"ip": "1", "pid": 7, "is_err": False, "lines": skipped[:2] + kept[:1]}
    printed = [line for b in ray_logging.stdout_deduplicator.deduplicate(batch) for line in b["lines"]]
    assert printed == kept[:1] or not ray_logging.RAY_DEDUP_LOGS      # RAY_DEDUP_LOGS=0 turns the skip off
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    tune_log = logging.getLogger("ray.tune.tune")
    tune_log.addHandler(handler)
    try:
        tune_log.warning("Wrote the latest version of all result files and experiment state to 'x' in 0.01s.")
        tune_log.warning("something else")
        p.on_experiment_end([])
        tune_log.warning("Wrote the latest version of all result files and experiment state to 'x' in 0.01s.")
    finally:
        tune_log.removeHandler(handler)
    assert [r.getMessage()[:9] for r in records] == ["something", "Wrote the"]
    assert ray_logging.stdout_deduplicator.skip_re.pattern == "^user pattern"
    assert ray_logging.stderr_deduplicator.skip_re is None and os.environ[progress.MLFLOW_URL_ENV] == "0"
    capsys.readouterr()


def test_flag_selects_ray_output_or_the_table():
    settings = SearchSettings(name="demo")
    plan = types.SimpleNamespace(name="demo", epochs=3)
    space = {"mix": {"weight": Float(1.0, 100.0, log=True)}}
    args = parse_args(settings, [])
    assert args.ray_output is None and progress.verbose(args) == 0
    assert os.environ[progress.ENGINE_ENV] == "0"      # Tune's legacy engine: silent at verbose=0, no box
    (cb,) = progress.callbacks(args, settings, plan, space)
    assert isinstance(cb, progress.SearchProgress) and cb.params == ["mix.weight"] and cb.full_epochs == 3
    for argv, level in ((["--ray-output"], 1), (["--ray-output", "2"], 2)):
        args = parse_args(settings, argv)
        assert progress.verbose(args) == level and progress.callbacks(args, settings, plan, space) == []
        assert progress.ENGINE_ENV not in os.environ    # put back as it was
    with pytest.raises(SystemExit):
        parse_args(settings, ["--ray-output", "3"])


def test_pickles_with_the_run_config_without_run_state(clock):
    import cloudpickle

    p = progress.SearchProgress("demo", ERR, "max", 4, PARAMS, interval_s=5)
    p._seen["x"] = {"epoch": 1, "last": 0.5, "best": 0.5}
    for dumps in (pickle.dumps, cloudpickle.dumps):
        q = pickle.loads(dumps(p))
        assert (q.name, q.metric, q.mode, q.full_epochs, q.params, q.interval_s) == ("demo", ERR, "max", 4, PARAMS, 5)
        assert q._seen == {} and os.environ[progress.ENGINE_ENV] == "0"   # a restored search stays quiet too
    progress.restore_engine()
    assert progress.ENGINE_ENV not in os.environ


def test_the_tests_search_env_drops_the_engine_variable_progress_sets():
    assert without_engine_env({progress.ENGINE_ENV: "0", "PATH": "/bin"}) == {"PATH": "/bin"}


@pytest.mark.slow
def test_ray_output_flag_gives_rays_own_output_back(search_env, tmp_path):
    out = run_search_script("cifar10_cowmix.py", ["--smoke-test", "--trials", "1", "--no-compile-ahead",
                                                  "--name", "prog-ray", "--ray-output", "--storage",
                                                  str(tmp_path / "ray")], without_engine_env(search_env), tmp_path)
    assert "Trial status:" in out.stdout and "Configuration for experiment" in out.stdout
    assert re.search(r"\] epoch 2/2 \|", out.stdout)                       # the trial's own epoch lines
    assert "prog-ray: 1 trials:" not in out.stdout and "done: 1 trials (0 failed)" in out.stdout


@pytest.mark.slow
def test_sigterm_stops_a_search_in_two_lines_and_the_same_command_resumes_it(tmp_path):
    """SIGTERM to a search's driver (local Ray, as a user starts it): no "*** SIGTERM received" stack dump from Ray's
    core (exit 134), but Tune's clean stop: the progress summary says it, one line says how to resume, exit status
    143, the MLflow parent run KILLED; the same command then finishes both trials."""
    from mlflow.tracking import MlflowClient

    from conftest import ROOT

    env = {k: v for k, v in without_engine_env(dict(os.environ)).items()
           if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "COWTUNE_STORAGE")}
    env.update(PYTHONUNBUFFERED="1", COWTUNE_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, str(ROOT / "search_spaces" / "cifar10_cowmix.py"), "--smoke-test", "--trials", "2",
           "--no-confirm", "--no-compile-ahead", "--name", "term", "--storage", str(tmp_path / "ray")]
    returncode, out, err = sigterm_once_started(cmd, env, tmp_path, "a progress table every")   # trials scheduled
    assert returncode == 143, err[-3000:]
    assert "SIGTERM received" not in err and "Traceback" not in err, err[-3000:]
    assert err.splitlines()[-1] == "term: stopped by SIGTERM; Ray saved its state: run the same command to resume"
    assert "Experiment has been interrupted" not in err and "Stop signal received" not in err, err[-3000:]
    assert re.search(r"^search term stopped by SIGTERM with 2 trials unfinished after \S+: 0 terminated, 0 pruned by "
                     r"ASHA, 0 errored$", out, re.M), out
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (parent,) = [r for r in client.search_runs([client.get_experiment_by_name("term").experiment_id])
                 if "mlflow.parentRunId" not in r.data.tags]
    assert parent.info.status == "KILLED"
    again = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "done: 2 trials (0 failed)" in again.stdout, again.stderr[-3000:]
    assert "2 terminated, 0 pruned by ASHA, 0 errored" in again.stdout


@pytest.mark.slow
def test_sigterm_stops_a_final_in_one_line_and_kills_its_parent_run(tmp_path):
    """SIGTERM to `cowtune final`'s driver (local Ray): Tune's clean stop, not Ray's stack dump; the summary counts
    no run as finished, one line says how to resume, exit status 143, the MLflow parent run KILLED."""
    from mlflow.tracking import MlflowClient

    (tmp_path / "p.yaml").write_text("model: cnn_tiny\nmix: {name: cowmix}\n"
                                     "train: {epochs: 3, steps_per_epoch: 20, batch_size: 16}\n")
    env = {k: v for k, v in without_engine_env(dict(os.environ)).items()
           if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "COWTUNE_STORAGE")}
    env.update(PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "trainables.cli", "final", "--config", "p.yaml", "--datasets", "digits=x",
           "--labels", "20", "--seeds", "2", "--no-supervised", "--set", "data.n_val=100", "--set",
           "data.eval_split=val", "--name", "fin"]
    returncode, out, err = sigterm_once_started(cmd, env, tmp_path, "final fin: 2 runs")   # runs scheduled
    assert returncode == 143, err[-3000:]
    assert "SIGTERM received" not in err and "Traceback" not in err, err[-3000:]
    assert err.splitlines()[-1] == "fin: stopped by SIGTERM; Ray saved its state: run the same command to resume"
    assert "final fin stopped by SIGTERM: 0 of 2 runs finished" in out, out
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (parent,) = [r for r in client.search_runs([client.get_experiment_by_name("fin").experiment_id])
                 if "mlflow.parentRunId" not in r.data.tags]
    assert parent.info.status == "KILLED"


def sigterm_once_started(cmd, env, cwd, ready: str) -> tuple[int, str, str]:
    """Start ``cmd``, SIGTERM it 3 s after a line of its stdout contains ``ready``; (exit status, stdout, stderr)."""
    import signal
    import time

    driver = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in driver.stdout:
            lines.append(line)
            if ready in line:
                break
        time.sleep(3)
        driver.send_signal(signal.SIGTERM)
        out, err = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    return driver.returncode, "".join(lines) + out, err
