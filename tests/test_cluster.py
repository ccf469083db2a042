"""The cluster platform: the launcher config and compose file are complete, and a search submitted as a
Ray job runs its trials on two Ray nodes (head + worker, `ray start` on this machine) and records them
in the MLflow server.

`ray submit platform/cluster.yaml ...` needs ssh to the head node (the launcher's only transport), which
CI does not have; the submission path tested here is the Jobs API (`ray job submit`) against nodes
started with `ray start`, which is what `ray submit` ends up running on the head.
"""
import copy
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from conftest import BIN, ROOT, free_port, start_ray_node, stop_group, wait_ray


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
    assert "." in raw["file_mounts"].values()


def test_compose_and_image_define_the_real_services():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"postgres", "mlflow", "ray-head"} <= set(services)
    for svc in services.values():
        assert all(str(p).startswith("127.0.0.1:") for p in svc.get("ports", []))
    env = (ROOT / "platform" / "mlflow.env").read_text()
    assert "MLFLOW_BACKEND_STORE_URI=postgresql" in env
    assert services["mlflow"]["command"][:2] == ["mlflow", "server"]
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
                          "--trials", "2", "--set", "train.steps_per_epoch=150", "--name", "cluster",
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
