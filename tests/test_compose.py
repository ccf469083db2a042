"""docker-compose.yml declares the team stack: PostgreSQL with the `mlflow` and `optuna` databases, the MLflow server
on the first with proxied artifacts, a Ray head, a Ray GPU worker that joins it, and optuna-dashboard on the second;
published on 127.0.0.1 only, with the database account only in the uncommitted .env.

The file is read with pyyaml (merge keys resolved, as Compose does). The one Compose implementation that installs
here is Debian's `docker-compose` package (Compose v1, 1.29.2, the last Python release; its PyPI wheel pins
PyYAML<6 and jsonschema<4, which the project's venv cannot take): its `config` command interpolates the file and
checks it against its Compose-spec JSON schema without a Docker engine. test_compose_validates_with_docker_compose
runs it, and is skipped where that package is not installed. Compose v2 (the `docker compose` plugin that users
run) comes from neither PyPI nor Debian; no Docker engine runs here, so nothing is started.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_TEXT = (ROOT / "docker-compose.yml").read_text()
COMPOSE = yaml.safe_load(COMPOSE_TEXT)
SERVICES = COMPOSE["services"]
IMAGE_SERVICES = ("mlflow", "ray-head", "ray-gpu-worker", "optuna-dashboard")   # all but postgres: platform/Dockerfile

# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?message}, ${NAME?message}; $${...} is a literal for the container
REF = re.compile(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")
REQUIRED_REF = r"\$\{[A-Za-z_][A-Za-z0-9_]*:\?[^}]*\}"   # set and non-empty, or Compose stops with the message
DB_URL = re.compile(rf"postgresql\+psycopg2://(?P<user>{REQUIRED_REF}):(?P<password>{REQUIRED_REF})"
                    r"@(?P<host>[\w.-]+):(?P<port>\d+)/(?P<db>\w+)")
SECRET_KEY = re.compile(r"PASSWORD|PASSWD|SECRET|TOKEN|API_KEY", re.I)


def strings(node):
    """Every string in the parsed file, keys included."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield str(k)
            yield from strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from strings(v)
    elif node is not None:
        yield str(node)


def env_of(svc: str) -> dict[str, str]:
    env = SERVICES[svc].get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) if "=" in e else (e, "") for e in env)
    return {k: str(v) for k, v in env.items()}


def command(svc: str) -> list[str]:
    cmd = SERVICES[svc]["command"]
    return [str(c) for c in (cmd if isinstance(cmd, list) else cmd.split())]


def option(cmd: list[str], name: str) -> str | None:
    """The value of `--name value` or `--name=value` in an argv."""
    for i, arg in enumerate(cmd):
        if arg == name and i + 1 < len(cmd):
            return cmd[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def db_url(text: str) -> re.Match:
    m = DB_URL.fullmatch(text)
    assert m, f"not a PostgreSQL URL whose user and password are required ${{...}} variables: {text!r}"
    return m


def mounts(svc: str) -> dict[str, str]:
    """Container path -> source of each volume of a service (short syntax)."""
    out = {}
    for v in SERVICES[svc].get("volumes", []):
        parts = v.split(":") if isinstance(v, str) else [v["source"], v["target"]]
        out[parts[1]] = parts[0]
    return out


def published(svc: str) -> list[str]:
    """Each published port as HOST_IP:HOST_PORT:CONTAINER_PORT (long syntax folded into it)."""
    out = []
    for p in SERVICES[svc].get("ports", []):
        if isinstance(p, dict):
            out.append(f"{p.get('host_ip', '')}:{p.get('published', '')}:{p.get('target')}")
        else:
            out.append(str(p))
    return out


def env_file_vars(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip().removeprefix("export ").strip()] = v.split(" #")[0].strip().strip("'\"")
    return out


def test_the_team_stack_services_exist():
    assert set(SERVICES) == {"postgres", "mlflow", "ray-head", "ray-gpu-worker", "optuna-dashboard"}
    assert SERVICES["postgres"]["image"].startswith("postgres:16")
    for svc in IMAGE_SERVICES:   # one image; each names its build, so Compose never pulls a `cowtune` image
        assert SERVICES[svc]["image"] == SERVICES["mlflow"]["image"], svc
        assert SERVICES[svc]["build"]["dockerfile"] == "platform/Dockerfile", svc
        assert Path(ROOT / SERVICES[svc]["build"]["context"], "platform/Dockerfile").is_file()


def test_postgres_holds_the_mlflow_and_optuna_databases():
    env = env_of("postgres")
    assert env["POSTGRES_DB"] == "mlflow"
    assert re.fullmatch(r"\$\{POSTGRES_USER:\?[^}]+\}", env["POSTGRES_USER"])
    assert re.fullmatch(r"\$\{POSTGRES_PASSWORD:\?[^}]+\}", env["POSTGRES_PASSWORD"])
    init = mounts("postgres")["/docker-entrypoint-initdb.d"]
    assert init.startswith("./platform/"), init
    sql = " ".join(p.read_text() for p in sorted((ROOT / init).glob("*")) if p.suffix in (".sql", ".sh"))
    assert re.search(r"CREATE\s+DATABASE\s+\"?optuna\b\"?\s*;", re.sub(r"--[^\n]*", "", sql), re.I), sql
    assert mounts("postgres")["/var/lib/postgresql/data"] in COMPOSE["volumes"]
    assert "pg_isready" in " ".join(SERVICES["postgres"]["healthcheck"]["test"])


def test_mlflow_server_stores_runs_in_postgres_and_proxies_artifacts():
    cmd = command("mlflow")
    assert cmd[:2] == ["mlflow", "server"]
    store = db_url(option(cmd, "--backend-store-uri"))
    assert (store["host"], store["port"], store["db"]) == ("postgres", "5432", "mlflow")
    assert store["user"].startswith("${POSTGRES_USER:?") and store["password"].startswith("${POSTGRES_PASSWORD:?")
    assert "--serve-artifacts" in cmd and "--no-serve-artifacts" not in cmd
    dest = option(cmd, "--artifacts-destination")
    assert dest == "/mlartifacts" and mounts("mlflow")[dest] in COMPOSE["volumes"]
    assert option(cmd, "--host") == "0.0.0.0" and option(cmd, "--port") == "5000"
    # The Ray nodes call it http://mlflow:5000, a browser http://127.0.0.1:5000: both Host headers are allowed.
    hosts = (option(cmd, "--allowed-hosts") or "*").split(",")
    assert "*" in hosts or {"mlflow:5000", "127.0.0.1:5000"} <= set(hosts), hosts
    assert "/health" in " ".join(SERVICES["mlflow"]["healthcheck"]["test"])
    assert SERVICES["mlflow"]["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_ray_head_and_gpu_worker():
    head = command("ray-head")
    assert head[:3] == ["ray", "start", "--head"] and "--block" in head
    assert option(head, "--port") == "6379" and option(head, "--dashboard-host") == "0.0.0.0"
    assert option(head, "--num-gpus") == "0"
    worker = command("ray-gpu-worker")
    assert worker[:2] == ["ray", "start"] and "--head" not in worker and "--block" in worker
    assert option(worker, "--address") == "ray-head:6379"
    devices = SERVICES["ray-gpu-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1 and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    # Ray is told as many GPUs as Docker reserves: the same number, or the same variable with the same default.
    gpus, count = option(worker, "--num-gpus"), str(devices[0]["count"])
    assert gpus == count and re.fullmatch(r"[1-9]\d*|\$\{\w+:-[1-9]\d*\}", gpus), (gpus, count)
    assert "replicas" not in SERVICES["ray-gpu-worker"].get("deploy", {})   # replicas would all get GPUs 0..N-1
    for svc in ("ray-head", "ray-gpu-worker"):
        env = env_of(svc)
        assert env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000", svc
        assert env["COWTUNE_STORAGE"].startswith("/mnt/cluster_storage/"), svc
        assert mounts(svc)["/mnt/cluster_storage"] == "cluster_storage" and "cluster_storage" in COMPOSE["volumes"]
        assert SERVICES[svc].get("shm_size") == SERVICES["ray-head"]["shm_size"], svc
    assert env_of("ray-head") == env_of("ray-gpu-worker")
    assert SERVICES["ray-gpu-worker"]["depends_on"]["ray-head"]["condition"] == "service_healthy"


def test_the_optuna_study_and_its_dashboard_use_the_optuna_database_of_the_same_server():
    store = db_url(option(command("mlflow"), "--backend-store-uri"))
    study = db_url(env_of("ray-head")["COWTUNE_OPTUNA_STORAGE"])
    assert study["db"] == "optuna"
    assert study.group("user", "password", "host", "port") == store.group("user", "password", "host", "port")
    cmd = command("optuna-dashboard")
    if cmd[:2] == ["sh", "-c"]:   # a shell line: `... && exec optuna-dashboard ... "$$COWTUNE_OPTUNA_STORAGE"`
        line = cmd[2].split("exec ", 1)[1]
        cmd = [a.strip("\"'") for a in line.split()]
        # optuna-dashboard does not create Optuna's tables: the line creates them first (a fresh volume)
        assert "RDBStorage(" in command("optuna-dashboard")[2]
    assert cmd[0] == "optuna-dashboard"
    assert option(cmd, "--host") == "0.0.0.0" and option(cmd, "--port") == "8080"
    url = cmd[-1]
    if url.startswith("$$"):   # the service's own variable, expanded by the container's shell
        url = env_of("optuna-dashboard")[url.lstrip("$").strip("{}")]
    assert db_url(url).group("user", "password", "host", "port", "db") == study.group(
        "user", "password", "host", "port", "db")


def test_every_published_port_is_on_loopback():
    ports = {svc: published(svc) for svc in SERVICES}
    for svc, ps in ports.items():
        for p in ps:
            assert p.startswith("127.0.0.1:"), f"{svc} publishes {p!r} beyond loopback"
    assert sorted(p.split(":")[1] for ps in ports.values() for p in ps) == ["5000", "8080", "8265"]
    assert ports["mlflow"] == ["127.0.0.1:5000:5000"] and ports["ray-head"] == ["127.0.0.1:8265:8265"]
    assert ports["optuna-dashboard"] == ["127.0.0.1:8080:8080"]
    for svc in SERVICES:   # nothing else bypasses the port list
        assert SERVICES[svc].get("network_mode") != "host", svc


def test_no_literal_password_in_the_compose_file():
    for s in strings(COMPOSE):
        # ${NAME:?any message} -> ${NAME:?}, so that a URL is one word; then its user and password must be such
        short = REF.sub(lambda m: "${" + m[1] + (m[2] or "") + "}", s)
        for url in re.findall(r"\w[\w+.-]*://[^\s\"']*@", short):
            assert re.search(r"://\$\{\w+:\?\}:\$\{\w+:\?\}@$", url), f"credentials in {url!r}"
    for svc in SERVICES:
        for key, value in env_of(svc).items():
            if SECRET_KEY.search(key):
                assert re.fullmatch(REQUIRED_REF, value), f"{svc}: {key}={value!r}"
    # No default value for the account anywhere (`${POSTGRES_PASSWORD:-mlflow}` would be a shipped password).
    for name, op, _ in REF.findall(COMPOSE_TEXT):
        if name.startswith("POSTGRES_") or SECRET_KEY.search(name):
            assert op == ":?", f"${{{name}{op}...}} in docker-compose.yml: the account must be required"
    assert "env_file" not in COMPOSE_TEXT   # the account comes from .env through ${...} only


def test_no_literal_password_in_committed_env_files():
    # What git would commit: tracked files and untracked ones that .gitignore does not exclude (so not .env)
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    files = [ROOT / f for f in listed if (ROOT / f).is_file()
             and (f.endswith(".env") or Path(f).name.startswith(".env.") or Path(f).name == ".env")]
    assert ROOT / ".env.example" in files
    for path in files:
        for key, value in env_file_vars(path).items():
            assert not (SECRET_KEY.search(key) and value), f"{path.relative_to(ROOT)}: {key} holds a value"
            assert not re.search(r"://[^/\s]*:[^@/\s]+@", value), f"{path.relative_to(ROOT)}: credentials in {key}"


def test_env_example_defines_every_variable_the_compose_file_needs():
    example = env_file_vars(ROOT / ".env.example")
    refs = REF.findall(COMPOSE_TEXT)
    required = {name for name, op, _ in refs if op not in (":-", "-")}
    assert {"POSTGRES_USER", "POSTGRES_PASSWORD"} <= required
    assert required <= set(example), f".env.example lacks {sorted(required - set(example))}"
    unused = set(example) - {name for name, _, _ in refs}
    assert not unused, f".env.example sets what docker-compose.yml does not use: {sorted(unused)}"
    assert example["POSTGRES_PASSWORD"] == ""   # empty: a copied .env does not start until a password is set


def test_dot_env_is_gitignored():
    def ignored(name: str) -> bool:
        return subprocess.run(["git", "check-ignore", "-q", "--no-index", name], cwd=ROOT).returncode == 0
    assert ignored(".env") and not ignored(".env.example")
    assert "/.env" in (ROOT / ".gitignore").read_text().splitlines()


def test_the_image_has_the_search_stack_cuda_torch_and_the_postgres_driver():
    text = (ROOT / "platform" / "Dockerfile").read_text()
    install = " ".join(line for line in text.splitlines() if "pip install" in line)
    for want in ('".[search]"', "psycopg2-binary", "optuna-dashboard"):
        assert want in install, want
    # PyPI's Linux x86_64 torch wheel is the CUDA build: no CPU-only index or wheel in the image
    assert not re.search(r"whl/cpu|\+cpu|--index-url", text)


@pytest.mark.skipif(shutil.which("docker-compose") is None,
                    reason="Compose v1 is not installed (Debian: apt-get install docker-compose)")
def test_compose_validates_with_docker_compose(tmp_path):
    env = tmp_path / "env"
    env.write_text("POSTGRES_USER=cowtune\nPOSTGRES_PASSWORD=only-for-this-test\n")
    compose = ["docker-compose", "--project-directory", str(ROOT), "-f", str(ROOT / "docker-compose.yml")]
    # With an account: valid. With .env.example as copied (password still empty): refused, naming the variable.
    # (The two run at once: each takes about 0.4 s.)
    ok, refused = [subprocess.Popen([*compose, "--env-file", str(f), "config", "-q"], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for f in (env, ROOT / ".env.example")]
    (_, ok_err), (_, refused_err) = ok.communicate(timeout=60), refused.communicate(timeout=60)
    assert ok.returncode == 0, ok_err
    assert refused.returncode != 0 and "POSTGRES_PASSWORD" in refused_err, refused_err
