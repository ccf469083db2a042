"""Carry the search stack (Ray Tune, Optuna, MLflow) to the GPU device machine as one xz tarball.

The device has Python 3.12 (x86_64, manylinux) with torch, numpy, pandas, pyarrow, ... but no ray, optuna or mlflow
and no network. This script, run here (network to PyPI), downloads the wheels of the versions in the local .venv
and of every dependency the device lacks, unpacks them into one site folder, drops what the device never uses
(Ray's Java jar and dashboard web client, MLflow's web UI, tests, stubs) and writes ``.devbundle/site.tar.xz``::

    python3 benchmarks/device_bundle.py build           # here: .devbundle/site.tar.xz (carry that one path)
    eval "$(python3 benchmarks/device_bundle.py install --target /tmp/site)"   # there: unpack, export PYTHONPATH

``install`` uses the standard library only; it prints the ``export PYTHONPATH=...`` line on stdout (progress on
stderr), so ``eval`` sets it. ``build --check-only`` re-checks an existing ``.devbundle/site``'s requirements.
"""

from __future__ import annotations

import argparse
import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT / ".devbundle"
WHEELS = BUNDLE / "wheels"
SITE = BUNDLE / "site"
TARBALL = BUNDLE / "site.tar.xz"

# What the search code imports (trainables/search/*.py): ray, ray.tune (+ ray.tune.search.optuna), ray.train
# (TorchTrainer, optional: trial.py), optuna (RDB storage), mlflow (MlflowClient, entities). Ray's `tune` extra
# covers ray.train too (same requirements as `train`); `default` (dashboard, metrics agent) is left out:
# experiments.init_ray starts Ray with include_dashboard=False, and without aiohttp_cors/opencensus Ray runs as a
# minimal install (no dashboard agent). mlflow-skinny and mlflow-tracing are requirements of mlflow.
ROOTS: dict[str, set[str]] = {"ray": {"tune"}, "optuna": set(), "mlflow": set()}

# Requirements left out: only MLflow's tracking server / UI / model serving use them, never `import mlflow` nor
# MlflowClient on a sqlite:/// or file: store. (`import mlflow` does import fastapi (mlflow.gateway) and looks
# for the `databricks` package (find_spec("databricks.agents")), and its SQL store's model registry imports
# cryptography.fernet: so fastapi, starlette, databricks-sdk and cryptography stay.)
SKIP = {
    "flask", "flask-cors", "gunicorn", "waitress", "graphene", "huey",   # mlflow server + UI + job queue
    "docker", "skops",                                                   # model serving, model (de)serialization
    "uvicorn",                                                           # the server's ASGI runner
    "python-dotenv",                                                     # mlflow CLI's .env loading
}

# The device image's packages ("Python packages already there" in the device notes, read 2026-11-17).
DEVICE = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp
""".split())

# On the device too, but bundled anyway: pydantic, alembic and typing-inspection need typing-extensions>=4.16,
# newer than the image may hold (its version is not listed); pure Python, backward compatible, 0.1 MB.
BUNDLE_ANYWAY = {"typing-extensions"}

# Paths (relative to the site folder) never used on the device.
DROP = [
    "ray/jars",                        # Java workers' jar (ray_dist.jar); Python-only here
    "ray/dashboard/client/build",      # dashboard web UI; init_ray passes include_dashboard=False
    "mlflow/server/js",                # MLflow web UI (the device never serves it)
]
DROP_DIRS = {"tests", "__pycache__"}   # any folder of these names
DROP_SUFFIXES = (".pyi", ".pyc", ".js.map")

DEVICE_ENV = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_version": "3.12.3",
    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
    "platform_python_implementation": "CPython", "implementation_name": "cpython", "platform_release": "",
    "platform_version": "",
}
PIP_PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                "--platform", "manylinux2014_x86_64"]


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------- build (here)

def _packaging():
    try:
        from packaging.requirements import Requirement
        from packaging.version import Version
    except ImportError:                     # pip's own copy
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.version import Version
    return Requirement, Version


def local_versions(venv: Path) -> dict[str, str]:
    out = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"],
                         check=True, capture_output=True, text=True).stdout
    return {canon(p["name"]): p["version"] for p in json.loads(out)}


def wheel_metadata(whl: Path) -> email.message.Message:
    with zipfile.ZipFile(whl) as z:
        # the wheel's own dist-info: top level (ray vendors others' dist-info under ray/.../thirdparty_files)
        name = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        return email.parser.Parser().parsestr(z.read(name).decode())


def find_wheel(name: str, version: str) -> Path | None:
    for w in WHEELS.glob("*.whl"):
        dist, ver = w.name.split("-")[:2]
        if canon(dist) == name and ver == version:
            return w
    return None


def download(name: str, version: str) -> Path:
    w = find_wheel(name, version)
    if w is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PIP_PLATFORM,
                        "-d", str(WHEELS), f"{name}=={version}"], check=True)
        w = find_wheel(name, version)
        if w is None:
            sys.exit(f"pip download {name}=={version} left no wheel in {WHEELS}")
    return w


def requirements(meta, extras: set[str]):
    Requirement, _ = _packaging()
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None:
            yield req
        elif any(req.marker.evaluate({**DEVICE_ENV, "extra": e}) for e in (extras or {""})):
            yield req


def resolve(venv: Path) -> tuple[dict[str, tuple[str, Path]], list[str]]:
    """Walk Requires-Dist from the roots: name -> (version, wheel) for every package the device lacks."""
    Requirement, Version = _packaging()
    have = local_versions(venv)
    chosen: dict[str, tuple[str, Path]] = {}
    notes: list[str] = []
    queue: list[tuple[str, set[str], str]] = [(n, e, "root") for n, e in ROOTS.items()]
    extras_done: dict[str, set[str]] = {}
    while queue:
        name, extras, why = queue.pop(0)
        if name in chosen and extras <= extras_done.get(name, set()):
            continue
        if name not in have:
            sys.exit(f"{name} (needed by {why}) is not in {venv}: install it there first")
        version = have[name]
        whl = chosen[name][1] if name in chosen else download(name, version)
        chosen[name] = (version, whl)
        extras_done[name] = extras_done.get(name, set()) | extras
        for req in requirements(wheel_metadata(whl), extras):
            dep = canon(req.name)
            if dep in SKIP:
                continue
            if dep in DEVICE and dep not in BUNDLE_ANYWAY:
                notes.append(f"{dep}{req.specifier} (for {name}) assumed from the device")
                continue
            if dep in have and req.specifier and not req.specifier.contains(Version(have[dep]), prereleases=True):
                sys.exit(f"{name} needs {req}, but the local .venv has {dep} {have[dep]}")
            queue.append((dep, set(req.extras), name))
    return chosen, notes


def unpack(whl: Path, site: Path) -> None:
    """Install a wheel the way pip --target does, keeping executable bits (ray's raylet, gcs_server)."""
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue                    # scripts, headers, data: unused on the device
                parts = parts[2:]
            if info.is_dir() or not parts[-1]:
                continue
            dest = site.joinpath(*parts)
            dest.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst)
            mode = (info.external_attr >> 16) & 0o777
            os.chmod(dest, 0o755 if mode & 0o111 else 0o644)


def prune(site: Path) -> int:
    freed = 0

    def size(p: Path) -> int:
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size

    for rel in DROP:
        p = site / rel
        if p.exists():
            freed += size(p)
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    for p in sorted(site.rglob("*"), key=lambda q: -len(q.parts)):
        if p.is_dir() and p.name in DROP_DIRS:
            freed += size(p)
            shutil.rmtree(p)
        elif p.is_file() and p.name.endswith(DROP_SUFFIXES):
            freed += p.stat().st_size
            p.unlink()
    return freed


def check_site(site: Path) -> list[str]:
    """Every Requires-Dist (device markers, chosen extras) of every bundled dist is met by the bundle, the device
    list (version unknown) or SKIP. Returns the problems."""
    Requirement, Version = _packaging()
    dists = {}
    for d in site.glob("*.dist-info"):
        meta = email.parser.Parser().parsestr((d / "METADATA").read_text())
        dists[canon(meta["Name"])] = (meta["Version"], meta)
    problems = []
    seen = {}
    for d in site.glob("*.dist-info"):
        n = canon(d.name.rsplit("-", 1)[0])
        seen.setdefault(n, []).append(d.name)
    problems += [f"two versions of {n}: {v}" for n, v in seen.items() if len(v) > 1]
    for name, (version, meta) in dists.items():
        for req in requirements(meta, ROOTS.get(name, set())):
            dep = canon(req.name)
            if dep in SKIP or (dep in DEVICE and dep not in dists):
                continue
            if dep not in dists:
                problems.append(f"{name} {version} needs {req}: not in the bundle")
            elif not req.specifier.contains(Version(dists[dep][0]), prereleases=True):
                problems.append(f"{name} {version} needs {req}: bundle has {dists[dep][0]}")
    return problems


def build(args: argparse.Namespace) -> None:
    if args.check_only:
        problems = check_site(SITE)
        print("\n".join(problems) or f"{SITE}: every requirement met (bundle, device list or SKIP)")
        sys.exit(1 if problems else 0)
    WHEELS.mkdir(parents=True, exist_ok=True)
    chosen, notes = resolve(Path(args.venv))
    for w in WHEELS.glob("*.whl"):              # one version of each: forget wheels of earlier builds
        if w not in {p for _, p in chosen.values()}:
            w.unlink()
    if SITE.exists():
        shutil.rmtree(SITE)
    SITE.mkdir(parents=True)
    for name in sorted(chosen):
        unpack(chosen[name][1], SITE)
    unpacked = sum(f.stat().st_size for f in SITE.rglob("*") if f.is_file())
    freed = prune(SITE)
    problems = check_site(SITE)
    (BUNDLE / "packages.txt").write_text("".join(f"{n}=={v}\n" for n, (v, _) in sorted(chosen.items())))
    log(f"{len(chosen)} packages: " + " ".join(f"{n}=={v}" for n, (v, _) in sorted(chosen.items())))
    log("from the device (versions not checked here): " + ", ".join(sorted({x.split('(')[0].strip() for x in notes})))
    log(f"unpacked {unpacked / 1e6:.1f} MB, pruned {freed / 1e6:.1f} MB")
    if problems:
        sys.exit("requirements not met:\n  " + "\n  ".join(problems))
    TARBALL.unlink(missing_ok=True)
    if args.no_tar:
        return
    tmp = TARBALL.with_suffix(".xz.tmp")
    with open(tmp, "wb") as out:
        tar = subprocess.Popen(["tar", "-C", str(SITE), "--owner=0", "--group=0", "--sort=name", "-cf", "-", "."],
                               stdout=subprocess.PIPE)
        subprocess.run(["xz", "-9", "-T0", "-c"], stdin=tar.stdout, stdout=out, check=True)
        if tar.wait() != 0:
            sys.exit("tar failed")
    tmp.rename(TARBALL)
    print(f"{TARBALL.relative_to(ROOT)}: {TARBALL.stat().st_size / 1e6:.1f} MB "
          f"({TARBALL.stat().st_size / 2**20:.1f} MiB); carry [\"{TARBALL.relative_to(ROOT)}\"]")


# ------------------------------------------------------------------------------------------- install (the device)

def install(args: argparse.Namespace) -> None:
    """Unpack the carried tarball into ``--target`` once and print the ``export`` line for ``eval``. A later call
    that no longer carries the tarball reuses what an earlier one unpacked. On failure it prints ``false``, so that
    ``eval "$(... install ...)" && ...`` stops there rather than going on without the packages."""
    target = Path(args.target).resolve()
    tarball = Path(args.tarball)
    stamp = target / ".devbundle-stamp"

    def fail(message: str) -> None:
        print("false")
        sys.exit(message)

    if not tarball.is_file():
        if not stamp.is_file():
            fail(f"{tarball} is missing and {target} holds no bundle: name it in the call's carry list")
        log(f"{target} holds the bundle an earlier call unpacked ({tarball} not carried this time)")
    else:
        key = f"{tarball.stat().st_size}:{int(tarball.stat().st_mtime)}"
        if stamp.is_file() and stamp.read_text() == key:
            log(f"{target} already holds {tarball}")
        else:
            if target.exists() and any(target.iterdir()):
                if not stamp.is_file():
                    fail(f"{target} is not empty and holds no earlier bundle: pick another --target")
                shutil.rmtree(target)
            target.mkdir(parents=True)
            with tarfile.open(tarball, "r:xz") as tar:
                if hasattr(tarfile, "data_filter"):
                    tar.extractall(target, filter="data")
                else:
                    tar.extractall(target)
            stamp.write_text(key)
            log(f"unpacked {tarball} into {target}")
    print(f"export PYTHONPATH={target}${{PYTHONPATH:+:$PYTHONPATH}}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="here: download, unpack, prune, write .devbundle/site.tar.xz")
    b.add_argument("--venv", default=str(ROOT / ".venv"), help="the environment whose versions to bundle")
    b.add_argument("--no-tar", action="store_true", help="stop after .devbundle/site (no tarball)")
    b.add_argument("--check-only", action="store_true", help="only check .devbundle/site's requirements")
    i = sub.add_parser("install", help="there: unpack the tarball, print the export PYTHONPATH line")
    i.add_argument("--target", default="/tmp/site")
    i.add_argument("--tarball", default=str(TARBALL))
    args = ap.parse_args()
    build(args) if args.cmd == "build" else install(args)


if __name__ == "__main__":
    main()
