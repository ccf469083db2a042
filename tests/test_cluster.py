"""The cluster platform: the launcher config and compose file are complete, `ray up` / `ray submit` /
`ray down` with platform/cluster.yaml run a search on the cluster they launch, and a search submitted as a
Ray job runs its trials on two Ray nodes (head + worker, `ray start` on this machine). Both record in the
MLflow server.

The launcher test's machine is this one, reached over ssh: its own sshd on 127.0.0.1 (a free port; the
launcher has no port setting, so `auth.ssh_proxy_command` connects with nc), in its own PID namespace so
that the `ray stop` of head_start_ray_commands and `ray down` only sees that node's Ray, with $HOME a
temp folder so the real file's ~/.bashrc and ~/venv setup never touch root's home. scripts/test.sh
installs openssh-server, rsync and nc; without them the test fails rather than skips.
"""
import contextlib
import copy
import getpass
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from conftest import BIN, ROOT, free_port, run_checked, start_ray_node, stop_group, wait_ray


def test_cluster_yaml_is_a_valid_launcher_config():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((ROOT / "platform" / "cluster.yaml").read_text())
    cfg = prepare_config(copy.deepcopy(raw))
    validate_config(cfg)
    assert raw["provider"]["worker_ips"] and raw["provider"]["head_ip"]
    setup = " ".join(raw["setup_commands"])
    assert "pip install" in setup and "[search]" in setup
    assert "MLFLOW_TRACKING_URI=" in setup and "COWTUNE_STORAGE=/mnt/cluster_storage" in setup
    assert "RAY_ADDRESS=auto" in setup        # the submitted script joins the cluster instead of starting its own
    assert any("/mnt/cluster_storage" in c for c in raw["initialization_commands"])
    assert any("--num-gpus=0" in c for c in raw["head_start_ray_commands"])
    assert "." in raw["file_mounts"].values() and raw["rsync_filter"] == [".gitignore"]   # not the venv, data, wheels


def test_compose_and_image_define_the_real_services():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"postgres", "mlflow", "ray-head"} <= set(services)
    for svc in services.values():
        assert all(str(p).startswith("127.0.0.1:") for p in svc.get("ports", []))
    assert services["mlflow"]["command"][:2] == ["mlflow", "server"]
    assert "postgresql" in " ".join(services["mlflow"]["command"])   # tests/test_compose.py checks the rest
    assert services["ray-head"]["environment"]["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert '".[search]"' in (ROOT / "platform" / "Dockerfile").read_text()


def submit_job(cmd: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    """`ray job submit`, retried while the head's job agent is still starting (HTTP 500 "No available agent")."""
    for _ in range(20):
        out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=420)
        if out.returncode == 0 or "No available agent" not in out.stdout + out.stderr:
            break
        time.sleep(3)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.mark.slow
def test_search_job_runs_trials_on_two_nodes(mlflow_server, ray_token_env, tmp_path):
    port, dash = free_port(), free_port()
    head = start_ray_node(tmp_path, ray_token_env, num_cpus=1, extra=(
        "--head", f"--port={port}", "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
        f"--temp-dir=/tmp/cowtune-ray-{port}"))
    worker = None
    try:
        wait_ray(f"127.0.0.1:{port}", 1, ray_token_env)
        worker = start_ray_node(tmp_path, ray_token_env, head_port=port, num_cpus=1)
        wait_ray(f"127.0.0.1:{port}", 2, ray_token_env)
        runtime_env = {"env_vars": {"MLFLOW_TRACKING_URI": mlflow_server, "RAY_USAGE_STATS_ENABLED": "0"}}
        out = submit_job([str(BIN / "ray"), "job", "submit", f"--address=http://127.0.0.1:{dash}",
                          f"--runtime-env-json={json.dumps(runtime_env)}", "--",
                          str(BIN / "python"), str(ROOT / "search_spaces" / "cifar10_cowmix.py"), "--smoke-test",
                          "--trials", "2", "--set", "train.steps_per_epoch=150", "--no-confirm", "--name", "cluster",
                          "--storage", str(tmp_path / "shared_storage")],
                         {**os.environ, **ray_token_env}, tmp_path)
        assert "done: 2 trials (0 failed)" in out.stdout, out.stdout[-3000:]
    finally:
        for proc in (worker, head):
            if proc is not None:
                stop_group(proc)
        shutil.rmtree(f"/tmp/cowtune-ray-{port}", ignore_errors=True)
    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("cluster")
    children = [r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
    assert len(children) == 2 and all(c.info.status == "FINISHED" for c in children)
    assert len({c.data.tags["worker.node_id"] for c in children}) == 2, out.stdout[-4000:]   # one trial per node


@dataclass(frozen=True)
class SshNode:
    port: int      # sshd on 127.0.0.1:port
    key: Path      # client key authorized for this user
    home: Path     # $HOME of every ssh session: the node's home folder

    def ssh(self, command: str) -> list[str]:
        return ["ssh", "-i", str(self.key), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                "-o", f"UserKnownHostsFile={os.devnull}", "-o", f"ProxyCommand=nc %h {self.port}",
                f"{getpass.getuser()}@127.0.0.1", command]


@pytest.fixture
def ssh_node(tmp_path):
    """This machine as a launcher node: our own sshd, keys and $HOME in tmp_path, stopped at the end."""
    tools = ("/usr/sbin/sshd", "ssh", "ssh-keygen", "rsync", "nc", "unshare")
    missing = [tool for tool in tools if not shutil.which(tool)]
    if missing or os.geteuid() != 0:
        pytest.fail(f"the launcher test needs root and {missing or 'its tools'}: scripts/test.sh installs them")
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.fail("the launcher test runs its node in a PID namespace (`unshare --pid --mount-proc`), which this "
                    f"machine refuses (an unprivileged container?): {probe.stderr.strip()}")
    d, home = tmp_path / "sshd", tmp_path / "home"
    d.mkdir()
    home.mkdir()
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    port = free_port()
    (d / "sshd_config").write_text("\n".join([
        "ListenAddress 127.0.0.1", f"Port {port}", f"HostKey {d / 'host_key'}", "PidFile none", "UsePAM no",
        f"AuthorizedKeysFile {d / 'client_key.pub'}", "AuthenticationMethods publickey",
        "PermitRootLogin prohibit-password",
        "StrictModes no",         # the key lies under world-writable /tmp
        f"SetEnv HOME={home}",    # ~/.bashrc, ~/venv, ~/ray_bootstrap_config.yaml land here, not in /root
    ]) + "\n")
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)      # privilege separation dir; Debian's service makes it
    log = open(d / "sshd.log", "w")
    # Own PID namespace: a `ray stop` over ssh stops only this node's Ray (not every test's), and stopping sshd,
    # the namespace's init, ends whatever is left in it.
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
                             "/usr/sbin/sshd", "-D", "-e", "-f", str(d / "sshd_config")],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    node = SshNode(port, d / "client_key", home)
    try:
        deadline = time.time() + 30
        while subprocess.run(node.ssh("true"), capture_output=True, timeout=30).returncode != 0:
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"sshd did not start: {(d / 'sshd.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield node
    finally:
        stop_group(proc)


def rewrite(command: str, replacements: dict[str, str]) -> str:
    for old, new in replacements.items():
        assert old in command, f"platform/cluster.yaml changed: {old!r} not in {command!r}"
        command = command.replace(old, new)
    return command


def launcher_config(node: SshNode, mlflow_uri: str, shared: Path, ray_port: int) -> dict:
    """platform/cluster.yaml with what must differ on this machine; every other key is the real file's."""
    cfg = yaml.safe_load((ROOT / "platform" / "cluster.yaml").read_text())
    remote, mount = "/home/cowtune/cowtune", str(node.home / "cowtune")
    cfg["cluster_name"] = f"cowtune-test-{node.port}"
    cfg["provider"].update(head_ip="127.0.0.1", worker_ips=[])   # a worker would need a second IP: the head alone
    cfg["min_workers"] = cfg["max_workers"] = 0
    cfg["auth"] = {"ssh_user": getpass.getuser(), "ssh_private_key": str(node.key),
                   "ssh_proxy_command": f"nc %h {node.port}"}   # the launcher always dials port 22
    cfg["file_mounts"] = {path.replace(remote, mount): src for path, src in cfg["file_mounts"].items()}
    cfg["initialization_commands"] = [f"mkdir -p {shared}"]        # stands in for the NFS mount
    make_venv, pip_install, bashrc = cfg["setup_commands"]
    assert "venv ~/venv" in make_venv and f'pip install -q -e "{remote}[search]"' in pip_install
    cfg["setup_commands"] = [
        f"ln -sfn {BIN.parent} ~/venv",                             # the tests' venv instead of venv + pip (no network)
        rewrite(bashrc, {"http://10.0.0.10:5000": mlflow_uri, "/mnt/cluster_storage": str(shared),
                         # the mounted copy is what runs, as after `pip install -e` of it
                         "'source ~/venv/bin/activate'": f"'source ~/venv/bin/activate' 'export PYTHONPATH={mount}'"})]
    stop, start = cfg["head_start_ray_commands"]
    assert stop.endswith("ray stop")                                 # kept: it sees only the node's PID namespace
    cfg["head_start_ray_commands"] = [stop, rewrite(start, {
        "--port=6379": f"--port={ray_port} --node-ip-address=127.0.0.1 --temp-dir=/tmp/cowtune-ray-{ray_port}"
                       f" --ray-client-server-port={free_port()} --dashboard-agent-listen-port={free_port()}"
                       " --object-store-memory=150000000 --disable-usage-stats",
        "--dashboard-host=0.0.0.0": f"--dashboard-host=127.0.0.1 --dashboard-port={free_port()}"})]
    return cfg


def forget_cluster(name: str, ray_port: int) -> None:
    """Remove what the launcher and the head keep outside tmp_path: temp dir, node state, config cache, ssh masters."""
    shutil.rmtree(f"/tmp/cowtune-ray-{ray_port}", ignore_errors=True)
    for suffix in ("state", "lock"):
        Path(f"/tmp/ray/cluster-{name}.{suffix}").unlink(missing_ok=True)
    for cache in Path(tempfile.gettempdir()).glob("ray-config-*"):
        if name in cache.read_text():
            cache.unlink()
    user_hash, name_hash = (hashlib.sha256(s.encode()).hexdigest()[:10] for s in (getpass.getuser(), name))
    control = Path(f"/tmp/ray_ssh_{user_hash}")
    for master in (control / name_hash).glob("*"):                # ControlPersist would keep them (and nc) 10 s
        subprocess.run(["ssh", "-o", f"ControlPath={master}", "-O", "exit", "127.0.0.1"], capture_output=True, timeout=30)
    shutil.rmtree(control / name_hash, ignore_errors=True)
    with contextlib.suppress(OSError):
        control.rmdir()                                            # unless another cluster's masters are there


@pytest.mark.slow
def test_ray_up_submit_down_run_a_search_on_the_launched_cluster(ssh_node, mlflow_server, tmp_path):
    shared, ray_port = tmp_path / "cluster_storage", free_port()
    cfg = launcher_config(ssh_node, mlflow_server, shared, ray_port)
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}

    def ray(command: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [str(BIN / "ray"), command, "--log-color", "false", *args]
        if check:
            return run_checked(cmd, env, ROOT, timeout=300)            # cwd ROOT: the file mount's "." is the repo
        return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)

    try:
        ray("up", "-y", "--no-config-cache", "--disable-usage-stats", str(config))
        code = ("import ray, trainables; ray.init(logging_level='ERROR'); "
                "print('probe', ray.get_runtime_context().get_node_id(), trainables.__file__)")
        probe = ray("exec", "--no-config-cache", str(config), f'python -c "{code}"')   # a login shell, as submit's
        node_id, trainables_file = re.search(r"probe (\w+) (\S+)", probe.stdout).groups()
        out = ray("submit", "--no-config-cache", str(config), str(ROOT / "search_spaces" / "cifar10_cowmix.py"),
                  "--", "--smoke-test", "--trials", "2", "--no-confirm", "--name", "ray-submit")
    finally:
        down = ray("down", "-y", str(config), check=False)          # (down has no --no-config-cache)
        left = subprocess.run(ssh_node.ssh("ps -eo comm="), capture_output=True, text=True, timeout=60).stdout.split()
        forget_cluster(cfg["cluster_name"], ray_port)
    assert down.returncode == 0 and not {"raylet", "gcs_server"} & set(left), down.stdout[-3000:] + str(left)
    assert "done: 2 trials (0 failed)" in out.stdout, out.stdout[-3000:]
    mount = ssh_node.home / "cowtune"
    assert trainables_file.startswith(str(mount))                    # the rsynced copy ran, without what git ignores
    assert (mount / "pyproject.toml").exists() and not any((mount / p).exists() for p in (".venv", "cowtune.egg-info"))
    assert (shared / "ray_results" / "ray-submit").is_dir()          # COWTUNE_STORAGE from the node's ~/.bashrc
    client = MlflowClient(mlflow_server)                               # MLFLOW_TRACKING_URI from the same place
    exp = client.get_experiment_by_name("ray-submit")
    children = [r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
    assert len(children) == 2 and all(c.info.status == "FINISHED" for c in children)
    assert {c.data.tags["worker.node_id"] for c in children} == {node_id}   # RAY_ADDRESS=auto: the launched head
