"""End to end on real services: a tiny search on a local Ray node recorded by an `mlflow server`, what it prints,
then `cowtune promote` and `cowtune final` on its result."""
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from conftest import BOX, ROOT, run_checked, run_search_script, without_engine_env
from trainables import metrics as M
from trainables.config import TrainConfig
from trainables.search.trial import learning_curve_png

pytestmark = pytest.mark.slow
COWTUNE = [sys.executable, "-m", "trainables.cli"]


def runs_of(uri, name):
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(name)
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return client, parents, children


@pytest.fixture(scope="module")
def search(search_env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("search")
    out = run_search_script("cifar10_cowmix.py", ["--smoke-test", "--trials", "3", "--concurrency", "1", "--no-confirm",
                                                  "--name", "e2e", "--storage", str(tmp / "ray")],
                            without_engine_env(search_env), tmp)
    return tmp, out


def test_the_search_prints_a_short_table(search):
    """The compact progress table (trainables/search/progress.py), not Ray Tune's boxes and per-epoch lines."""
    out = search[1]
    lines = (out.stdout + out.stderr).splitlines()
    assert len(lines) < 60, out.stdout + out.stderr
    text = out.stdout
    assert re.search(r"^\[0:\d\d:\d\d\] e2e: 3 trials: \d running, \d terminated, \d pruned, 0 errored, \d pending$",
                     text, re.M), text
    assert re.search(r"^  trial +state +epoch +last +best +sigma_range +prop_range +weight +conf_thresh +alpha +anneal"
                     r" +lr_per_256 +warmup_epochs$", text, re.M), text
    assert re.search(r"^  [0-9a-f]{8}  terminated +2/2  0\.\d{4}  0\.\d{4}  4\.\.16 ", text, re.M), text  # paper point
    assert re.search(r"^search e2e finished after \S+: 3 terminated, 0 pruned by ASHA, 0 errored; best ", text, re.M)
    assert "done: 3 trials (0 failed)" in text and "best trial " in text
    assert "Trial status" not in text and "Configuration for experiment" not in text
    assert not re.search(r"\] epoch \d+/\d+ \|", text + out.stderr)          # no per-epoch lines of the trials
    assert "Checkpoint successfully created" not in out.stderr
    assert text.count("View run ") == 1                   # MLflow's link to the parent run only (a tracking server)
    assert not BOX & set(text)


def test_every_search_module_the_ray_experiment_names_imports(search):
    """Ray stores the searcher, the callbacks and the progress table in ``tuner.pkl`` (and the searcher's state) by
    module path (docs/journal/2026-12-03-search-rooms.md, §4): each ``trainables.search`` module named there must
    import, or a search started before a module was renamed cannot resume."""
    import importlib

    files = [p for p in (search[0] / "ray").rglob("*.pkl") if p.name == "tuner.pkl" or p.name.startswith("searcher")]
    names = {m.decode() for p in files for m in re.findall(rb"trainables\.search\.[a-z_]+", p.read_bytes())}
    assert files and names, (files, names)
    for name in sorted(names):
        importlib.import_module(name)


def test_search_records_parent_child_runs_metrics_and_artifacts(search, mlflow_server, tmp_path):
    assert "done: 3 trials (0 failed)" in search[1].stdout
    client, parents, children = runs_of(mlflow_server, "e2e")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert len(children) == 3
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
    assert len({c.data.tags["ray.trial_id"] for c in children}) == 3
    ordered = sorted(children, key=lambda c: c.info.start_time)
    paper = [round(float(x), 6) for x in ordered[0].data.params["mix.sigma_range"].strip("[]").split(",")]
    assert paper == [4.0, 16.0] and float(ordered[0].data.params["mix.weight"]) == 30.0   # paper point first
    for c in children:
        assert c.info.status == "FINISHED"
        lo, hi = (float(x) for x in c.data.params["mix.sigma_range"].strip("[]").split(","))
        assert 1.0 <= lo and hi <= 32.0 and hi / lo >= 1.5 - 1e-9       # sampled ranges never empty/inverted
        history = client.get_metric_history(c.info.run_id, M.VAL_ERROR_TEACHER)
        assert sorted(m.step for m in history) == [1, 2] and all(math.isfinite(m.value) for m in history)
        for tag in ("dataset", "n_labeled", "split.val", "split.labeled", "mlflow.source.git.commit", "ray.trial_id"):
            assert c.data.tags[tag], tag
        assert c.data.tags["dataset"] == "digits" and c.data.tags["n_labeled"] == "50"
        assert not any(k.startswith("test/") for k in c.data.metrics)
        arts = {a.path for a in client.list_artifacts(c.info.run_id)}
        assert {"config.yaml", "masks.png", "learning_curve.png", "checkpoint"} <= arts
        # The curve is the driver's final one over both epochs (the trial drew only its first: within 30 s)
        rows = {}
        for key in c.data.metrics:
            for m in client.get_metric_history(c.info.run_id, key):
                rows.setdefault(m.step, {"epoch": m.step})[key] = m.value
        logged = Path(client.download_artifacts(c.info.run_id, "learning_curve.png", str(tmp_path))).read_bytes()
        full = learning_curve_png([rows[1], rows[2]], tmp_path / "full.png", c.info.run_name).read_bytes()
        first = learning_curve_png([rows[1]], tmp_path / "first.png", c.info.run_name).read_bytes()
        assert logged == full != first
    # Data are loaded once per worker process: with one trial at a time the actor is reused.
    assert len({c.data.tags["worker.pid"] for c in ordered}) == 1
    assert [c.data.tags["worker.data_cache_hit"] for c in ordered] == ["False", "True", "True"]


def test_promote_registers_best_full_budget_trial(search, search_env, mlflow_server):
    """Without a confirm stage (--no-confirm), only with --unconfirmed: the single best trial is partly seed luck."""
    tmp = search[0]
    refused = subprocess.run([*COWTUNE, "promote", "--search", "e2e", "--out", str(tmp / "p.yaml")], env=search_env,
                             cwd=tmp, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and not (tmp / "p.yaml").exists()
    assert "has no confirm stage" in refused.stderr and "--unconfirmed" in refused.stderr, refused.stderr
    out = run_checked([*COWTUNE, "promote", "--search", "e2e", "--unconfirmed", "--out", str(tmp / "promoted.yaml")],
                      search_env, tmp)
    assert "Downloading artifacts" not in out.stdout + out.stderr   # issue 54 item 11: no MLflow download bars
    client, _, children = runs_of(mlflow_server, "e2e")
    objective = M.mean_of_last(M.VAL_ERROR_TEACHER, 3)   # the search file's: the last 3 epochs' mean (here 2)
    best = min(children, key=lambda c: (c.data.metrics[objective], c.info.start_time))
    version = client.get_model_version_by_alias("e2e", "champion")
    assert client.get_run(version.run_id).data.metrics[objective] == best.data.metrics[objective]
    text = (tmp / "promoted.yaml").read_text()
    assert f"# run_id: {version.run_id}" in text and "# gate: unconfirmed" in text
    trial = yaml.safe_load(Path(client.download_artifacts(version.run_id, "config.yaml", str(tmp))).read_text())
    assert trial["train"].pop("threads") == 1   # the trial's CPU share: not promoted
    assert TrainConfig.from_dict(yaml.safe_load(text)).to_dict() == TrainConfig.from_dict(trial).to_dict()


def test_final_trains_seeds_on_test_split_and_writes_table(search, search_env, mlflow_server, digits_tree):
    tmp = search[0]
    if not (tmp / "promoted.yaml").exists():
        run_checked([*COWTUNE, "promote", "--search", "e2e", "--unconfirmed", "--out", str(tmp / "promoted.yaml")],
                    search_env, tmp)
    out = run_checked([*COWTUNE, "final", "--config", str(tmp / "promoted.yaml"), "--datasets",
                       f"imagefolder={digits_tree}", "--labels", "20", "--seeds", "2", "--name", "fin",
                       "--storage", str(tmp / "ray"), "--out", str(tmp / "final")], search_env, tmp)
    table = (tmp / "final" / "final_table.md").read_text()
    assert table in out.stdout
    # one line a run as it ends (issue 54: not Ray Tune's verbose output, 545 lines for 4 runs)
    ended = [line for line in out.stdout.splitlines() if "] final " in line and " seed " in line]
    assert len(ended) == 4 and all("imagefolder 20 labels" in line for line in ended), out.stdout
    assert "Trial status" not in out.stdout and len(out.stdout.splitlines()) < 40, out.stdout
    row = [line for line in table.splitlines() if line.startswith("| imagefolder | 20 |")]
    assert len(row) == 1 and row[0].count("(n=2)") == 2          # CowMix and supervised, 2 seeds each
    client, parents, children = runs_of(mlflow_server, "fin")
    assert len(parents) == 1 and len(children) == 4
    assert {c.data.tags["seed"] for c in children} == {"0", "1"}
    for c in children:
        assert "test/error_teacher" in c.data.metrics and "val/error_teacher" not in c.data.metrics
    assert {a.path for a in client.list_artifacts(parents[0].info.run_id)} >= {"final_table.md", "final_results.json"}


def test_a_search_or_final_run_again_with_other_settings_names_them(search, search_env, mlflow_server, digits_tree):
    """The same name with other settings is refused before Ray starts, exit status 2, naming what differs (a larger
    --trials is not refused: it grows the search, tests/test_team_stack.py); the parent run records its settings as
    parameters (what the MLflow UI shows)."""
    tmp = search[0]
    again = subprocess.run([sys.executable, str(ROOT / "search_spaces" / "cifar10_cowmix.py"), "--smoke-test",
                            "--trials", "3", "--concurrency", "1", "--name", "e2e", "--storage", str(tmp / "ray"),
                            "--set", "mix.weight=5.5"],
                           env=search_env, cwd=tmp, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2, again.stdout + again.stderr
    # (and search.points: the search file's second point takes omega from the base config)
    assert "was started with other settings (differs in: config.mix.weight (30.0 -> 5.5)" in again.stderr
    assert "Traceback" not in again.stderr and "Ray" not in again.stdout
    client, parents, _ = runs_of(mlflow_server, "e2e")
    assert parents[0].data.params["search.trials"] == "3" and parents[0].data.params["config.model"] == "cnn_tiny"
    if not (tmp / "promoted.yaml").exists():
        run_checked([*COWTUNE, "promote", "--search", "e2e", "--unconfirmed", "--out", str(tmp / "promoted.yaml")],
                    search_env, tmp)
    final = [*COWTUNE, "final", "--config", str(tmp / "promoted.yaml"), "--datasets", f"imagefolder={digits_tree}",
             "--labels", "20", "--seeds", "1", "--no-supervised", "--name", "fin-val", "--storage", str(tmp / "ray"),
             "--out", str(tmp / "final-val"), "--set", "data.n_val=100", "--set", "data.eval_split=val"]
    out = run_checked(final, search_env, tmp)
    assert "1/1 runs finished" in out.stdout, out.stdout[-2000:]          # scored on its holdout, and counted
    table = (tmp / "final-val" / "final_table.md").read_text()
    assert "Holdout error %" in table and table.count("(n=1)") == 1
    other = subprocess.run([*final[:final.index("--seeds") + 1], "2", *final[final.index("--seeds") + 2:]],
                           env=search_env, cwd=tmp, capture_output=True, text=True, timeout=300)
    assert other.returncode == 2 and "differs in: final.seeds (1 -> 2)" in other.stderr, other.stderr
    assert (tmp / "final-val" / "final_table.md").read_text() == table   # the old table is left as it was


def test_final_on_data_without_a_test_split_is_refused_before_ray(search, search_env):
    tmp = search[0]
    if not (tmp / "promoted.yaml").exists():
        run_checked([*COWTUNE, "promote", "--search", "e2e", "--unconfirmed", "--out", str(tmp / "promoted.yaml")],
                    search_env, tmp)
    out = subprocess.run([*COWTUNE, "final", "--config", str(tmp / "promoted.yaml"), "--datasets", "digits=unused",
                          "--labels", "20", "--seeds", "1", "--name", "fin-digits", "--storage", str(tmp / "ray")],
                         env=search_env, cwd=tmp, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "dataset 'digits' (unused) has no test split to report" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp / "ray" / "fin-digits").exists()


def test_a_second_driver_of_one_search_is_refused_naming_the_first(search_env, tmp_path):
    """Two searches of one name on one storage at once joined one experiment and trained a trial twice: the second
    driver is refused before Ray, naming the process that holds the search (the lock is a real flock, held here by
    another process)."""
    storage = tmp_path / "ray"
    storage.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from trainables.search.experiments import lock_job; "
        f"lock_job('dup', {str(storage)!r}, 'search'); print('held', flush=True); time.sleep(120)")],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        out = subprocess.run([sys.executable, str(ROOT / "search_spaces" / "cifar10_cowmix.py"), "--smoke-test",
                              "--name", "dup", "--storage", str(storage)], env=search_env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
        assert f"search dup in {storage} is running already (pid {holder.pid} on " in out.stderr
        assert "Traceback" not in out.stderr and not (storage / "dup").exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_search_on_an_image_that_cannot_be_decoded_names_it_before_any_trial(search_env, mlflow_server, tmp_path):
    """Every trial used to fail on it, retry, and leave the MLflow parent RUNNING: the driver names the file first."""
    from test_data import _zip_with_a_truncated_jpeg
    root = _zip_with_a_truncated_jpeg(tmp_path / "bad.zip")
    out = subprocess.run([sys.executable, str(ROOT / "search_spaces" / "cifar10_cowmix.py"), "--smoke-test",
                          "--data", str(root), "--set", "data.dataset=imagefolder", "--name", "bad-image",
                          "--storage", str(tmp_path / "ray"), "--no-compile-ahead"],
                         env=search_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "cannot be decoded, train/b/007.jpg (OSError" in out.stderr and "Traceback" not in out.stderr
    assert MlflowClient(mlflow_server).get_experiment_by_name("bad-image") is None   # no run left RUNNING


def test_an_unreachable_tracking_server_is_one_line_within_seconds(tmp_path):
    """Nothing listening, and a socket that accepts and never answers: each is one line within the check's 5 s
    (MLflow's own retries took 256 s, then five chained tracebacks), before Ray or any file."""
    import os
    import socket
    import time

    from conftest import free_port
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)                      # connections queue up; nothing ever reads or answers them
    try:
        started = []   # the four commands at once (each mostly waits)
        for uri in (f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{silent.getsockname()[1]}"):
            env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
            env.pop("RAY_ADDRESS", None)
            for cmd in ([sys.executable, str(ROOT / "search_spaces" / "cifar10_cowmix.py"), "--smoke-test",
                         "--storage", str(tmp_path / "ray")],
                        [*COWTUNE, "promote", "--search", "x", "--out", str(tmp_path / "p.yaml")]):
                proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
                started.append((uri, proc, time.monotonic()))
        for uri, proc, t0 in started:
            stdout, stderr = proc.communicate(timeout=120)
            assert proc.returncode == 2, stdout[-1500:] + stderr[-1500:]
            assert f"the MLflow tracking server {uri} (MLFLOW_TRACKING_URI) did not answer within 5 s" in stderr
            assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1
            assert time.monotonic() - t0 < 60
        assert not (tmp_path / "ray").exists() and not (tmp_path / "p.yaml").exists()
    finally:
        silent.close()


def test_a_trial_whose_loss_goes_nan_fails_with_its_reason_and_the_search_ends(search_env, mlflow_server, tmp_path):
    """Not a silent 90% error: the trial is an ERROR in Tune, its MLflow run FAILED with the reason as a tag, the
    parent FAILED, and the driver ends with its count instead of a traceback ('No best trial found')."""
    out = subprocess.run([sys.executable, str(ROOT / "search_spaces" / "cifar10_cowmix.py"), "--smoke-test",
                          "--trials", "1", "--name", "nan", "--storage", str(tmp_path / "ray"), "--set",
                          "optim.l2=1e12", "--no-compile-ahead"], env=search_env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    # every trial failed: exit status 1, one line saying so and why, no promote hint
    assert out.returncode == 1 and "done:" not in out.stdout and "cowtune promote" not in out.stdout
    assert re.search(r"^nan: error: every trial failed \(1 of 1\); the first: .*the training loss became nan",
                     out.stderr, re.M), out.stderr[-3000:]
    _, parents, children = runs_of(mlflow_server, "nan")
    assert parents[0].info.status == "FAILED" and [c.info.status for c in children] == ["FAILED"]
    assert children[0].data.tags["cowtune.failure"].startswith("TrainingDiverged: the training loss became nan")
    # Ray's retries (max_failures) do not train the failing epoch again: each stops at once with the reason
    assert "not retried, TrainingDiverged: the training loss became nan" in out.stdout, out.stdout[-3000:]


def test_unwritable_outputs_are_refused_before_any_work(search, search_env, mlflow_server, tmp_path):
    """A path that is a file, or lies under one, as --out or --storage: one line, exit status 2, before any
    training, Ray or registry change (promote moved the alias before it failed to write, once)."""
    blocker = tmp_path / "a-file"   # (the `search` fixture made the registered model e2e)
    blocker.write_text("x")
    client = MlflowClient(mlflow_server)
    before = [(v.version, v.aliases) for v in client.search_model_versions("name='e2e'")]
    cases = [([*COWTUNE, "promote", "--search", "e2e", "--out", str(blocker / "p.yaml")],
              f"--out {blocker / 'p.yaml'} lies under the file {blocker}"),
             ([*COWTUNE, "promote", "--search", "e2e", "--out", str(tmp_path)], f"--out {tmp_path} is a folder"),
             ([*COWTUNE, "final", "--config", str(blocker), "--datasets", "digits=x", "--out", str(blocker / "t")],
              f"--out {blocker / 't'} lies under the file {blocker}"),
             ([sys.executable, str(ROOT / "search_spaces" / "cifar10_cowmix.py"), "--smoke-test", "--storage",
               str(blocker)], f"--storage {blocker} is a file")]
    started = [(subprocess.Popen(cmd, env=search_env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True), message) for cmd, message in cases]   # at once: each mostly imports
    for proc, message in started:
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 2 and message in stderr and "Traceback" not in stderr, stderr[-2000:]
    assert [(v.version, v.aliases) for v in client.search_model_versions("name='e2e'")] == before


def test_embedded_defaults_and_a_relative_data_path(tmp_path, digits_tree):
    """No settings at all: Ray starts locally, MLflow writes ./mlflow.db and ./mlartifacts (the laptop path); and
    `--data` relative to where the user runs the search reaches every trial, although Ray runs trials in other
    folders. (One search for both: each starts a local Ray of its own.)"""
    import os
    import shutil
    shutil.copytree(digits_tree, tmp_path / "mydata")
    shared = ("MLFLOW_TRACKING_URI", "RAY_ADDRESS", "COWTUNE_STORAGE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE")
    env = {k: v for k, v in os.environ.items() if k not in shared}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    out = run_search_script("cifar10_cowout.py", ["--smoke-test", "--trials", "1", "--data", "mydata", "--set",
                                                  "data.dataset=imagefolder", "--set", "data.n_val=30",
                                                  "--set", "data.n_labeled=20"], env, tmp_path)
    assert "mlflow ui --backend-store-uri sqlite:///mlflow.db" in out.stdout
    forwarded = [line for line in (out.stdout + out.stderr).splitlines() if "(train_trial pid=" in line]
    assert forwarded and not any("\x1b[" in line for line in forwarded), forwarded   # a pipe: no colour codes
    assert (tmp_path / "mlflow.db").exists() and (tmp_path / "ray_results" / "cifar10_cowout-smoke").is_dir()
    client, parents, children = runs_of(f"sqlite:///{tmp_path / 'mlflow.db'}", "cifar10_cowout-smoke")
    assert len(parents) == 1 and len(children) == 1 and children[0].info.status == "FINISHED"
    assert children[0].info.artifact_uri.startswith((tmp_path / "mlartifacts").as_uri())
    assert "perturb.sigma_range" in children[0].data.params
    assert children[0].data.params["data.root"] == str(tmp_path / "mydata")
    missing = subprocess.run([sys.executable, str(ROOT / "search_spaces" / "cifar10_cowmix.py"), "--smoke-test",
                              "--data", "nowhere"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "--data must name an existing dataset folder or zip" in missing.stderr
    assert "Traceback" not in missing.stderr
