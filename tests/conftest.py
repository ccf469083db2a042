"""Real services for the search tests: an `mlflow server`, a Ray head node and PostgreSQL, all on 127.0.0.1.

Each is started once per test session as a child process in its own process group and stopped
by that group id at the end (never `ray stop`, which would stop every Ray node of the user).
"""
from __future__ import annotations

import glob
import importlib.util
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PG_BIN = next(iter(sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)), None)   # Debian's server

# Ray starts its worker processes (a search's trials) at nice 15, below everything else. On 2 cores shared with the
# other workers' tests, a local Ray's trials then got almost no CPU: the benchmark's packing mode, 44 s alone, took
# 374 s beside six busy loops and timed out at 600 s in the suite (122 s at nice 0). Every Ray the tests start, local
# or `ray start`, inherits this from the environment.
os.environ.setdefault("RAY_worker_niceness", "0")

_GIVEN_PORTS: set[int] = set()

# The suite runs on pytest-xdist workers (scripts/test.sh). Each worker is a pytest session of its own, so it starts
# its own session services (Ray head, MLflow server, PostgreSQL; each on free ports and in folders of its own) when a
# test there first asks for them, and runs one test at a time: two tests that share one server never run at once.
# A test module runs whole on one worker (its module fixtures start once). The one exception: the tests that start
# a local Ray of their own (`ray.init(address="local")`: a search with embedded defaults, under SIGTERM, on a full
# disk, the benchmark's search and packing modes) form one scope, "local-ray", and run one after another on one
# worker, as in a serial run. Two local Rays at once do work (the second's dashboard agent cannot bind Ray's fixed
# port 52365 and carries on without its HTTP service), but each believes it has every core and runs trials on all
# of them: with these seven as scopes of their own, the suite took 2039 s on 4 workers, against 1027 s serial.
LOCAL_RAY_TESTS = (
    "test_bad_inputs.py::test_a_search_whose_storage_fills_up_ends_in_one_line_naming_it",
    "test_benchmark.py::test_packing_mode_tiny_cpu",
    "test_benchmark.py::test_search_mode_tiny_cpu",
    "test_search.py::test_embedded_defaults_and_a_relative_data_path",
    "test_search_progress.py::test_sigterm_stops_a_final_in_one_line_and_kills_its_parent_run",
    "test_search_progress.py::test_sigterm_stops_a_search_in_two_lines_and_the_same_command_resumes_it",
    "test_search_progress.py::test_the_driver_breaks_ties_alike_on_a_first_run_and_a_restored_one",
)


def xdist_scope(nodeid: str) -> str:
    """The xdist scope of a test: ``local-ray`` or its module's path."""
    module, _, name = nodeid.partition("::")
    return "local-ray" if f"{_stem(nodeid)}.py::{name.split('[')[0]}" in LOCAL_RAY_TESTS else module


def _stem(nodeid: str) -> str:
    """``tests/test_search.py::test_x[a]`` -> ``test_search``."""
    return nodeid.partition("::")[0].rsplit("/", 1)[-1].removesuffix(".py")


# Scopes of 25 s or more, longest first (seconds on 2 cores busy with other work too, 2026-12-03, e9b41be; the
# README's suite on 2 workers): the workers take them first, then the rest in collection order, so no long scope
# starts last and leaves the other workers idle at the end.
LONG_SCOPES = {"local-ray": 517, "tests/test_search.py": 286, "tests/test_benchmark.py": 199,
               "tests/test_team_stack.py": 187, "tests/test_cluster.py": 182, "tests/test_search_confirm.py": 171,
               "tests/test_tracking_outage.py": 150, "tests/test_fast_path.py": 141, "tests/test_bad_inputs.py": 122,
               "tests/test_end_to_end.py": 121, "tests/test_search_resume.py": 112, "tests/test_compile_ahead.py": 97,
               "tests/test_data_parallel.py": 89, "tests/test_search_ddp.py": 64, "tests/test_cli.py": 62,
               "tests/test_bn_relu_pair.py": 62, "tests/test_stored_grad.py": 51, "tests/test_data.py": 47,
               "tests/test_trainer.py": 47, "tests/test_compile_lock.py": 47, "tests/test_imagenet_benchmark.py": 43,
               "tests/test_search_asha.py": 40, "tests/test_search_summary.py": 33, "tests/test_search_progress.py": 31,
               "tests/test_fast_conv.py": 28, "tests/test_legacy_checkpoints.py": 28, "tests/test_wgrad_stream.py": 26}


# The fast tier (`pytest -m "not slow"`, at most 2 minutes on 2 cores; README, "Development"): besides the tests marked
# @pytest.mark.slow in their files, these take 4 s or more each on 2 busy cores (a whole module where it ends in
# "::"). Measured with COWTUNE_TEST_TIMELINE on 2026-12-02; matched as a part of the test's id.
SLOW_TESTS = (
    "test_bad_inputs.py::test_a_disk_that_fills_mid_run_is_named_and_nothing_is_left_half_written",
    "test_bad_inputs.py::test_bad_input_is_refused_in_one_line_leaving_nothing[evaluate-json-on-a-full-disk]",
    "test_bad_inputs.py::test_bad_input_is_refused_in_one_line_leaving_nothing[final-out-on-a-full-disk]",
    "test_bad_inputs.py::test_bad_input_is_refused_in_one_line_leaving_nothing[final-storage-on-a-full-disk]",
    "test_bad_inputs.py::test_bad_input_is_refused_in_one_line_leaving_nothing[masks-out-on-a-full-disk]",
    "test_bad_inputs.py::test_bad_input_is_refused_in_one_line_leaving_nothing[promote-out-on-a-full-disk]",
    "test_bad_inputs.py::test_bad_input_is_refused_in_one_line_leaving_nothing[promote-unknown-search]",
    "test_bad_inputs.py::test_bad_input_is_refused_in_one_line_leaving_nothing[search-running-already]",
    "test_bad_inputs.py::test_bad_input_is_refused_in_one_line_leaving_nothing[search-storage-on-a-full-disk]",
    "test_bad_inputs.py::test_bad_input_is_refused_in_one_line_leaving_nothing[search-storage-on-a-read-only-disk]",
    "test_bad_inputs.py::test_bad_input_is_refused_in_one_line_leaving_nothing[train-out-on-a-full-disk]",
    "test_bad_inputs.py::test_bad_input_is_refused_in_one_line_leaving_nothing[train-out-on-a-read-only-disk]",
    "test_bad_inputs.py::test_bad_input_is_refused_in_one_line_leaving_nothing[train-out-the-full-disk-itself]",
    "test_benchmark.py::",
    "test_bn_relu_pair.py::test_compiled_switched_block_is_the_eager_block",
    "test_bn_relu_pair.py::test_gpu_check_of_the_kernels_runs_in_the_interpreter",
    "test_bn_relu_pair.py::test_kernels_add_many_chunks_in_tiles",
    "test_bn_relu_pair.py::test_kernels_give_the_formulas_gradients[4-32-8-8-2]",
    "test_boundaries.py::test_search_driver_skips_the_compiler_stack",
    "test_checkpoints.py::test_a_full_disk_leaves_the_last_checkpoint_intact",
    "test_checkpoints.py::test_a_truncated_checkpoint_resumes_from_the_epoch_before_and_ends_where_an_undisturbed_run_does",
    "test_cli.py::test_a_file_that_is_not_a_zip_is_named_as_such",
    "test_cli.py::test_final_checks_its_datasets_before_ray_starts",
    "test_cli.py::test_list_shows_registries",
    "test_cli.py::test_masks_bad_option_is_one_clear_error_naming_the_option",
    "test_cli.py::test_masks_gallery_and_npy",
    "test_cli.py::test_train_runs_resumes_and_rejects_bad_input",
    "test_compile_ahead.py::test_a_trial_after_compile_ahead_loads_every_graph",
    "test_compile_ahead.py::test_bad_invocation_says_how_to_call_it",
    "test_compile_lock.py::",
    "test_conv_rows.py::test_batch_norm_relu_prologue_per_segment",
    "test_conv_rows.py::test_forward_input_and_weight_gradients_match_pytorch[3-16-32-8-8-config0]",
    "test_conv_rows.py::test_forward_input_and_weight_gradients_match_pytorch[5-64-32-8-4-config2]",
    "test_conv_rows.py::test_weight_gradient_is_deterministic",
    "test_data.py::test_compiled_augmentation_gives_the_eager_views",
    "test_data.py::test_decode_in_worker_processes_matches_one_process",
    "test_data.py::test_flip_off_never_flips_and_on_flips",
    "test_data.py::test_train_view_is_a_window_of_the_padded_labeled_image",
    "test_end_to_end.py::",
    "test_evaluate.py::test_command_runs_as_a_user_runs_it",
    "test_fast_conv.py::test_compiled_switched_layers_match_eager",
    "test_fast_conv.py::test_cuda_kernels_of_the_operators_in_the_interpreter",
    "test_fast_conv.py::test_operator_registrations_agree",
    "test_fast_conv.py::test_switch_takes_biased_and_same_padded_layers",
    "test_fast_conv.py::test_switched_shakeshake_computes_the_same",
    "test_fast_path.py::test_compiled_step_matches_eager_step",
    "test_fast_path.py::test_deferred_running_statistics_are_the_layers_own",
    "test_fast_path.py::test_fast_path_learns_what_the_plain_path_learns_over_a_whole_schedule",
    "test_imagenet_benchmark.py::test_smoke_mode_measures_each_input_and_says_where",
    "test_imagenet_data_parallel.py::test_two_gloo_workers_on_jpeg_files_train_the_weights_of_one_process",
    "test_imagenet_preset.py::test_cowtune_train_with_the_preset_starts_and_validates_on_an_imagenet_tree",
    "test_inductor_options.py::test_the_models_reads_threshold_reaches_inductor_in_forward_and_backward",
    "test_legacy_checkpoints.py::test_a_run_stopped_in_the_old_layout_resumes_in_the_new",
    "test_legacy_checkpoints.py::test_upgraded_optimizer_continues_the_old_run",
    "test_search_inputs.py::test_every_child_run_logs_each_range_as_numeric_lo_and_hi_params",
    "test_search_summary.py::test_a_grown_search_logs_its_new_best_as_the_next_step",
    "test_search_summary.py::test_a_study_with_no_finished_trial_records_counts_and_no_best",
    "test_search_summary.py::test_the_parent_run_carries_the_best_trial_a_description_and_the_study_plots",
    "test_search_summary.py::test_too_few_trials_still_give_the_plots_that_can_be_drawn",
    "test_stored_grad.py::test_compiled_gradients_are_unchanged_and_stored_in_the_traced_layout",
    "test_stored_grad.py::test_registered_after_inductor_made_the_operator_a_fallback",
    "test_stored_grad.py::test_shake_shake_block_with_its_input_gradient_stored_or_not",
    "test_stored_grad.py::test_the_registration_keys_the_compile_caches",
    "test_team_stack.py::",
    "test_trainer.py::test_resume_is_bit_exact",
    "test_trainer.py::test_resume_with_shake_shake_gates_is_bit_exact",
    "test_trainer.py::test_running_out_of_memory_stops_the_run_in_one_line_naming_what_to_lower",
    "test_wgrad_stream.py::test_switched_layers_under_autocast_and_compile_match",
)


def pytest_collection_modifyitems(config, items):
    """Marks SLOW_TESTS, refuses names in SLOW_TESTS or LOCAL_RAY_TESTS that match no test, and puts the long scopes
    first on a worker."""
    for item in items:
        if any(part in item.nodeid for part in SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
    whole_files = not config.option.keyword and all("::" not in a for a in config.args)
    collected = {_stem(item.nodeid) + ".py" for item in items}
    for listed, names in (("SLOW_TESTS", SLOW_TESTS), ("LOCAL_RAY_TESTS", LOCAL_RAY_TESTS)):
        stale = [part for part in names if whole_files and part.partition("::")[0] in collected
                 and not any(part in item.nodeid for item in items)]
        if stale:
            raise pytest.UsageError(f"{listed} in tests/conftest.py names tests that no longer exist: {', '.join(stale)}")
    if os.environ.get("PYTEST_XDIST_WORKER"):   # xdist schedules by the workers' order: the long scopes first
        items.sort(key=lambda item: -LONG_SCOPES.get(xdist_scope(item.nodeid), 0))


if importlib.util.find_spec("xdist"):
    def pytest_xdist_make_scheduler(config, log):
        from xdist.scheduler import LoadScopeScheduling

        class ByScope(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return xdist_scope(nodeid)

        config.option.loadscopereorder = False   # keep the collection's order (long scopes first), not by test count
        return ByScope(config, log)


TIMELINE = os.environ.get("COWTUNE_TEST_TIMELINE")   # a file: when each test started and ended, on which worker
if TIMELINE:
    import resource

    def _mark(event: str, what: str) -> None:
        """One line: the time, the worker, the event, the CPU seconds so far of the worker and of the children it
        waited for (a test's CPU time is the difference between its start and end), and the test."""
        cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                  for f in ("ru_utime", "ru_stime"))
        with open(TIMELINE, "a") as f:
            f.write(f"{time.time():.2f} {os.environ.get('PYTEST_XDIST_WORKER', 'main')} {event} {cpu:.2f} {what}\n")

    def pytest_sessionstart(session):
        _mark("session", "start")

    def pytest_collection_finish(session):
        _mark("collected", str(len(session.items)))

    def pytest_runtest_logstart(nodeid, location):
        _mark("start", nodeid)

    def pytest_runtest_logfinish(nodeid, location):
        _mark("end", nodeid)

    def pytest_sessionfinish(session, exitstatus):
        _mark("session", "end")


@pytest.fixture(autouse=True)
def torch_threads():
    """A test that trains with ``train.threads`` sets the process's thread count (as `cowtune train` should): put it
    back after the test, so that the tests after it on the same worker run as they would alone."""
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch else None
    yield
    if before is not None and torch.get_num_threads() != before:
        torch.set_num_threads(before)


def import_for_triton(module: str, interpreted: bool):
    """``module`` (re)imported with its Triton kernels defined for Triton's interpreter (CPU tensors) or its compiler.
    Triton decides when ``@triton.jit`` runs, i.e. at import, so TRITON_INTERPRET is set (or unset) around the import
    and restored afterwards: no other test module sees it."""
    import importlib

    prev = os.environ.pop("TRITON_INTERPRET", None)
    if interpreted:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        if module in sys.modules:
            return importlib.reload(sys.modules[module])
        return importlib.import_module(module)
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
        if prev is not None:
            os.environ["TRITON_INTERPRET"] = prev


def free_port() -> int:
    """A free port on 127.0.0.1 that no earlier call in this session returned (calls back to back, before
    anything binds, could otherwise get the same one)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port


def stop_group(proc: subprocess.Popen, timeout: float = 5) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="session")
def ray_token_env(tmp_path_factory) -> dict[str, str]:
    """Token authentication for the test cluster: the nodes and every client share one token file."""
    path = tmp_path_factory.mktemp("ray-auth") / "token"
    path.write_text(secrets.token_hex(32))
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path), "RAY_USAGE_STATS_ENABLED": "0"}


def start_ray_node(tmp: Path, auth: dict, head_port: int | None = None, num_cpus: int = 2,
                   extra: tuple = ()) -> subprocess.Popen:
    """`ray start --block` as a child; with head_port it joins that head as a worker node. Ports that Ray
    fixes by default (the dashboard agent's 52365, the client server's 10001) are chosen free, so two
    nodes on this host never race for one."""
    cmd = [str(BIN / "ray"), "start", "--block", "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}",
           "--num-gpus=0", "--object-store-memory=150000000", "--disable-usage-stats",
           f"--dashboard-agent-listen-port={free_port()}", *extra]
    cmd += [f"--address=127.0.0.1:{head_port}"] if head_port else [f"--ray-client-server-port={free_port()}"]
    env = {**os.environ, **auth}
    log = open(tmp / f"ray-node-{time.time_ns()}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ray(address: str, nodes: int, auth: dict, timeout: float = 90) -> None:
    code = f"import ray; ray.init(address='{address}', logging_level='ERROR'); print(len([n for n in ray.nodes() if n['Alive']]))"
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **auth})
        if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(nodes)]:
            return
        time.sleep(2)
    raise RuntimeError(f"Ray at {address} did not get {nodes} live nodes in {timeout}s")


def mlflow_server_env() -> dict[str, str]:
    """The environment for an `mlflow server`: without its four job-runner processes (MLflow's GenAI jobs, unused
    here), which on 2 cores would import mlflow five times over at every start."""
    return {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def start_mlflow_server(tmp: Path, port: int) -> subprocess.Popen:
    """A real MLflow tracking server (SQLite backend in ``tmp``, proxied artifacts) on 127.0.0.1:``port``, answering.
    Started again on the same folder and port, it serves the same runs."""
    log = open(tmp / "server.log", "a")
    proc = subprocess.Popen(
        [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}", "--artifacts-destination", str(tmp / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp, env=mlflow_server_env())
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                stop_group(proc)
                raise RuntimeError(f"mlflow server did not start: {(tmp / 'server.log').read_text()[-2000:]}")
            time.sleep(1)


def wait_until(what: str, ok, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    """Poll ``ok()`` until true; raise with the tail of ``log`` if ``proc`` exits or ``timeout`` s pass first."""
    deadline = time.time() + timeout
    while not ok():
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"{what} did not start: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.5)


def _as_postgres(cmd: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: as root, run it as Debian's postgres user."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


def start_postgres(password: str) -> tuple[subprocess.Popen, int, Path]:
    """A PostgreSQL server (user ``cowtune``, ``password``) on 127.0.0.1, answering: its process, port and folder."""
    folder = Path(tempfile.mkdtemp(prefix="cowtune-pg-"))   # not under pytest's root-only temp folders
    (folder / "pw").write_text(password)
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        for p in (folder, folder / "pw"):
            os.chown(p, user.pw_uid, user.pw_gid)
    subprocess.run(_as_postgres([f"{PG_BIN}/initdb", "-D", str(folder / "data"), "-U", "cowtune", "-A",
                                 "scram-sha-256", f"--pwfile={folder / 'pw'}", "--no-locale", "-E", "UTF8"]),
                   check=True, capture_output=True)
    port, log = free_port(), folder / "postgres.log"
    proc = subprocess.Popen(_as_postgres([f"{PG_BIN}/postgres", "-D", str(folder / "data"), "-h", "127.0.0.1",
                                          "-p", str(port), "-k", str(folder), "-c", "fsync=off"]),
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    ready = [f"{PG_BIN}/pg_isready", "-h", "127.0.0.1", "-p", str(port)]
    wait_until("PostgreSQL", lambda: subprocess.run(ready, capture_output=True).returncode == 0, proc, log)
    return proc, port, folder


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server on loopback, once per session (skipped where Debian's package is not installed;
    scripts/test.sh installs it): a function that creates a database and returns its SQLAlchemy URL."""
    if PG_BIN is None:
        pytest.skip("PostgreSQL's server is not installed (scripts/test.sh does)")
    import psycopg2

    password = os.urandom(12).hex()
    proc, port, folder = start_postgres(password)

    def database(name: str) -> str:
        conn = psycopg2.connect(host="127.0.0.1", port=port, user="cowtune", password=password, dbname="postgres")
        conn.autocommit = True
        conn.cursor().execute(f"CREATE DATABASE {name}")
        conn.close()
        return f"postgresql+psycopg2://cowtune:{password}@127.0.0.1:{port}/{name}"

    try:
        yield database
    finally:
        os.killpg(proc.pid, signal.SIGINT)   # PostgreSQL's fast shutdown (SIGTERM waits for every client to leave)
        proc.wait(30)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """URI of a real MLflow tracking server (SQLite backend, proxied artifacts) on loopback."""
    port = free_port()
    proc = start_mlflow_server(tmp_path_factory.mktemp("mlflow"), port)
    yield f"http://127.0.0.1:{port}"
    stop_group(proc)


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory, ray_token_env):
    """Address of a real local Ray head node (2 CPUs) on loopback, for searches run as subprocesses."""
    tmp = tmp_path_factory.mktemp("ray")
    port = free_port()
    temp = Path(f"/tmp/cowtune-ray-{port}")   # own temp dir: no /tmp/ray/ray_current_cluster for other drivers to find
    proc = start_ray_node(tmp, ray_token_env, extra=("--head", f"--port={port}", "--include-dashboard=false",
                                                     f"--temp-dir={temp}"))
    address = f"127.0.0.1:{port}"
    try:
        wait_ray(address, 1, ray_token_env)
        yield address
    finally:
        stop_group(proc)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="session")
def search_env(mlflow_server, ray_head, ray_token_env, tmp_path_factory):
    return {**os.environ, **ray_token_env, "MLFLOW_TRACKING_URI": mlflow_server, "RAY_ADDRESS": ray_head,
            "PYTHONUNBUFFERED": "1", "COWTUNE_CACHE": str(tmp_path_factory.mktemp("cache"))}


BOX = set("╭╮╰╯│├┤─┼")   # Ray Tune's boxed status tables: the search's own progress table draws none


def without_engine_env(env: dict) -> dict:
    """``env`` without RAY_AIR_NEW_OUTPUT (``trainables.search.progress.ENGINE_ENV``): the output users get by
    default, whatever the environment the tests started in."""
    return {k: v for k, v in env.items() if k != "RAY_AIR_NEW_OUTPUT"}


def run_search_script(script: str, args: list[str], env: dict, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_checked([sys.executable, str(ROOT / "search_spaces" / script), *args], env, cwd, timeout)


def run_checked(cmd: list[str], env: dict, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def digits_tree(tmp_path_factory) -> Path:
    """A tiny ImageFolder tree with train/ and test/ splits (digits as 32x32 PNGs, 10 classes)."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    root = tmp_path_factory.mktemp("digits_tree")
    d = load_digits()
    counts: dict[tuple[str, int], int] = {}
    for img, label in zip(d.images, d.target):
        n = counts.get(("all", label), 0)
        if n >= 20:
            continue
        counts[("all", label)] = n + 1
        split = "train" if n < 15 else "test"
        path = root / split / str(label) / f"{n:03d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        arr = (np.kron(img, np.ones((4, 4))) * (255 / 16)).astype(np.uint8)
        Image.fromarray(np.stack([arr] * 3, -1)).save(path)
    return root
