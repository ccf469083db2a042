"""Bad input never starts a search or a run (issue 39, item 7): one table of bad inputs, each given to the command a
user would type (``cowtune train|promote|final|evaluate|masks`` and the search script), each refused with one error
line naming what is wrong, exit status 2, no traceback, and nothing left behind: the folder the case ran in (the
working directory, where ./mlflow.db, ./ray_results and runs/ would go) holds exactly the files it held before.

In-process: ``trainables.cli.main(argv)`` and the search script run as ``__main__`` (``runpy``), stderr read with
capsys. Guards make any case that got past its checks fail loudly instead of building a model or starting Ray.
Only the lock cases start a process: the lock of a search or of a `cowtune train` --out folder must be held by
another process (a flock), as in tests/test_search.py; and the full-disk cases run the command in a process of its
own, in a user and mount namespace where ./full is a tmpfs with one free page (the kernel's ENOSPC, made for real and
without privilege; skipped where the kernel allows no such namespace).

After the table, what is not refused but must still come out right: a 16-bit PNG read as 8 bits, a disk that fills
mid-run said in one line, the default --out of runs with overrides, and `evaluate` on a run's own training images.
"""
from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from conftest import ROOT, free_port
from test_data import _write_tree, _zip_tree, _zip_with_a_truncated_jpeg
import trainables.trainer
from trainables.cli import main

SCRIPT = ROOT / "search_spaces" / "cifar10_cowmix.py"
CACHE = ".cache"   # COWTUNE_CACHE of every case: decode locks may stay there, decoded arrays may not


@dataclass
class Ctx:
    """What a case's build step gets: the case's folder (also the working directory), and where to add a
    substring of the error known only once the input exists (a process id)."""
    tmp: Path
    monkeypatch: pytest.MonkeyPatch
    defer: Callable[[Callable[[], None]], None]
    expect: list[str] = field(default_factory=list)

    def write(self, rel: str, text: str | bytes) -> Path:
        path = self.tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
        return path

    def tree(self, rel: str, classes: int = 3, per_class: int = 6, size: int = 16, split_dirs: bool = False) -> Path:
        _write_tree(self.tmp / rel, classes, per_class, size, split_dirs)
        return self.tmp / rel


@dataclass
class Case:
    id: str
    cmd: str                            # "cowtune" (trainables.cli.main) or "search" (search_spaces/cifar10_cowmix.py)
    build: Callable[[Ctx], list[str]]   # writes the input under ctx.tmp; returns the command's arguments
    expect: tuple[str, ...]             # substrings of the one error line
    usage: bool = False                 # an argparse error: its usage block, then the error line
    within_s: float | None = None       # the error comes within this many seconds
    cached: bool = False                # refused after the images were decoded: their (complete) cache may stay
    full_disk: bool | str = False       # run where ./full is a full disk (a tmpfs with one free page), or a tmpfs
                                        # mounted with these options ("ro"): see FULL


# ------------------------------------------------------------------------------------------------ inputs

def sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def digits(*overrides: str, out: str = "run") -> Callable[[Ctx], list[str]]:
    """`cowtune train fast` on scikit-learn's digits (no files), with ``overrides``."""
    return lambda t: ["train", "fast", *sets("data.dataset=digits", "data.n_val=300", "data.n_labeled=50",
                                             "train.device=cpu", *overrides), "--out", out]


def images(make: Callable[[Ctx], Path], *overrides: str) -> Callable[[Ctx], list[str]]:
    """`cowtune train fast` on the ImageFolder tree or zip that ``make`` writes (3 classes x 6 images of 16x16)."""
    return lambda t: ["train", "fast", *sets(f"data.root={make(t)}", "data.n_val=3", "data.n_labeled=6",
                                             "train.device=cpu", *overrides), "--out", "run"]


def config_file(text: str | bytes, *args: str) -> Callable[[Ctx], list[str]]:
    return lambda t: ["train", str(t.write("my.yaml", text)), *args, "--out", "run"]


def tree_with(rel: str, text: str | bytes | None = None, image: tuple | None = None) -> Callable[[Ctx], Path]:
    """The standard tree, with the file ``rel`` replaced by ``text`` or by an image of ``(mode, (w, h))``."""
    def make(t: Ctx) -> Path:
        root = t.tree("tree")
        if image is not None:
            from PIL import Image
            Image.new(image[0], image[1]).save(root / rel)
        else:
            (root / rel).write_bytes(text) if isinstance(text, bytes) else (root / rel).write_text(text)
        return root
    return make


def truncated_first(t: Ctx) -> Path:
    root = t.tree("tree")
    from PIL import Image
    (root / "class0" / "000.png").unlink()
    Image.open(root / "class0" / "001.png").save(root / "class0" / "000.jpg")
    data = (root / "class0" / "000.jpg").read_bytes()
    (root / "class0" / "000.jpg").write_bytes(data[: len(data) // 3])
    return root


def one_image_class(t: Ctx) -> Path:
    root = t.tree("tree")
    for p in sorted((root / "class2").iterdir())[1:]:
        p.unlink()
    return root


def extra_test_class(t: Ctx) -> Path:
    root = t.tree("split", split_dirs=True)
    (root / "test" / "class2").rename(root / "test" / "zebra")
    return root


def loose_images(t: Ctx) -> Path:
    from PIL import Image
    (t.tmp / "loose").mkdir()
    for i in range(3):
        Image.new("RGB", (16, 16)).save(t.tmp / "loose" / f"{i}.png")
    return t.tmp / "loose"


def empty_zip(t: Ctx) -> Path:
    zipfile.ZipFile(t.tmp / "empty.zip", "w").close()
    return t.tmp / "empty.zip"


def linked(rel: str, target: str) -> Callable[[Ctx], Path]:
    """The standard tree with a symbolic link ``rel`` -> ``target`` (relative to the link's folder)."""
    def make(t: Ctx) -> Path:
        root = t.tree("tree")
        (root / rel).symlink_to(target)
        return root
    return make


def out_in_use(t: Ctx) -> list[str]:
    """Another process holds the --out folder's lock, as a first `cowtune train` into it does."""
    from trainables.trainer import RUN_LOCK
    (t.tmp / "run").mkdir()
    holder = lock_held_elsewhere(t, "from trainables.file_locks import hold_job_lock; "
                                    f"hold_job_lock({str(t.tmp / 'run' / RUN_LOCK)!r}, 'train')")
    t.expect.append(f"(pid {holder.pid} on ")
    return digits()(t)


def lock_held_elsewhere(t: Ctx, take_lock: str) -> subprocess.Popen:
    """A second process that runs ``take_lock`` (Python) and holds it until the case ends."""
    holder = subprocess.Popen([sys.executable, "-c", f"import time; {take_lock}; print('held', flush=True); "
                               "time.sleep(120)"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    t.defer(lambda: (holder.kill(), holder.wait()))
    assert holder.stdout.readline().strip() == "held"
    return holder


def search(*args: str, storage: str = "ray") -> Callable[[Ctx], list[str]]:
    return lambda t: ["--smoke-test", "--storage", storage, *args]


def unreachable_tracking(argv: list[str]) -> Callable[[Ctx], list[str]]:
    def build(t: Ctx) -> list[str]:
        t.monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")   # nothing listens there
        return argv
    return build


def search_running_already(t: Ctx) -> list[str]:
    """Another process holds the search's lock, as a first driver does (tests/test_search.py)."""
    storage = t.tmp / "ray"
    storage.mkdir()
    holder = lock_held_elsewhere(t, "from trainables.search.experiments import lock_job; "
                                    f"lock_job('dup', {str(storage)!r}, 'search')")
    t.expect.append(f"search dup in {storage} is running already (pid {holder.pid} on ")
    return ["--smoke-test", "--name", "dup", "--storage", str(storage)]


def promote_from_a_store(t: Ctx) -> list[str]:
    """A local MLflow store under the case's folder holding one search, e2e (made before the snapshot), and
    `cowtune promote` of a search it does not hold."""
    from mlflow.tracking import MlflowClient
    uri = f"sqlite:///{t.tmp / 'mlflow.db'}"
    MlflowClient(uri).create_experiment("e2e")
    t.monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return ["promote", "--search", "cifar10_cowmix", "--out", "p.yaml"]


def promoted(t: Ctx, text: str = "model: cnn_tiny\nmix: {name: cowmix}\n") -> str:
    return str(t.write("promoted.yaml", text))


def final(*args: str, text: str = "model: cnn_tiny\nmix: {name: cowmix}\n") -> Callable[[Ctx], list[str]]:
    return lambda t: ["final", "--config", promoted(t, text), "--storage", "ray", "--out", "fin", *args]


def checkpoint(t: Ctx, root: str = "gone", weights: bool = False) -> str:
    """A run folder with a checkpoint of cnn_tiny over classes blue, green, red (32x32), not trained: every
    evaluate case is refused before a model is built."""
    import torch
    from trainables.config import TrainConfig
    cfg = TrainConfig.from_dict({"model": "cnn_tiny", "data": {"dataset": "imagefolder", "root": root}})
    record = {"class_names": ["blue", "green", "red"], "mean": [0.5] * 3, "std": [0.25] * 3,
              "image_shape": [3, 32, 32], "pipeline": "device"}
    (t.tmp / "run").mkdir()
    from trainables.models import create_model
    state = create_model("cnn_tiny", 3).state_dict() if weights else {}
    torch.save({"config": cfg.to_dict(), "epoch": 1, "student": state, "teacher": state, "data": record},
               t.tmp / "run" / "checkpoint.pt")
    return str(t.tmp / "run")


def a_torch_file(t: Ctx, obj) -> Path:
    import torch
    (t.tmp / "other").mkdir()
    torch.save(obj, t.tmp / "other" / "checkpoint.pt")
    return t.tmp / "other" / "checkpoint.pt"


def scored(make: Callable[[Ctx], Path]) -> Callable[[Ctx], list[str]]:
    return lambda t: ["evaluate", "--checkpoint", checkpoint(t), "--data", str(make(t)), "--device", "cpu"]


def colour_tree(t: Ctx, names=("blue", "green", "red"), bad: tuple[str, bytes | None] | None = None) -> Path:
    """test/<class>/000.png, 001.jpg (32x32) with the class folders renamed to ``names``, and the file ``bad[0]``
    replaced by ``bad[1]`` (None: its first third, truncated)."""
    from test_evaluate import _write_tree as write_colours
    write_colours(t.tmp / "scored", {"test": 2})   # test/<blue|green|red>/000.png, 001.jpg
    for old, new in zip(("blue", "green", "red"), names):
        if old != new:
            (t.tmp / "scored" / "test" / old).rename(t.tmp / "scored" / "test" / new)
    if bad is not None:
        data = (t.tmp / "scored" / "test" / bad[0]).read_bytes()
        (t.tmp / "scored" / "test" / bad[0]).write_bytes(data[: len(data) // 3] if bad[1] is None else bad[1])
    return t.tmp / "scored"


def colour_tree_with_a_broken_link(t: Ctx) -> Path:
    root = colour_tree(t)
    (root / "test" / "red" / "zzz.png").symlink_to("gone.png")
    return root


FULL = "full"   # a full_disk case's full disk, a folder of the case's: a tmpfs with one free page (4 KiB)


def full_disk_cases_can_run() -> bool:
    """A user and mount namespace of its own (unshare -rm, no privilege needed where the kernel allows it): where a
    tmpfs can be mounted that no other process sees, a disk that fills as a real one does."""
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def on_a_tmpfs(mount: Path, options: str, argv: list[str], **kw) -> subprocess.CompletedProcess:
    """``argv`` run in a private user and mount namespace where ``mount`` is a fresh tmpfs mounted with ``options``
    ("size=4k": the kernel says ENOSPC when it fills, as on a full disk; "ro": EROFS); only that process sees it, and
    it is gone when it ends."""
    return subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o "$0" tmpfs "$1" && shift && exec "$@"',
                           options, str(mount), *argv], capture_output=True, text=True, **kw)


IN_A_NAMESPACE = f"""
import json, runpy, sys
from pathlib import Path
argv, cmd = json.loads(sys.argv[1]), sys.argv[2]
try:
    if cmd == "cowtune":
        from trainables.cli import main
        code = main(argv)
    else:
        sys.argv = [{str(SCRIPT)!r}, *argv]
        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
except SystemExit as exc:
    code = exc.code
print("LEFT ON THE FULL DISK " + json.dumps(sorted(str(p) for p in Path({FULL!r}).rglob("*"))))
sys.exit(code)
"""


def invoke_on_a_full_disk(case: Case, argv: list[str], tmp: Path, capsys) -> int:
    """The case's command in a process of its own where ./full is a full disk; its output as capsys would show it.
    Fails the case if anything is left on the full disk."""
    options = case.full_disk if isinstance(case.full_disk, str) else "size=4k"
    r = on_a_tmpfs(tmp / FULL, options, [sys.executable, "-c", IN_A_NAMESPACE, json.dumps(argv), case.cmd],
                   cwd=tmp, timeout=120)
    out, left = r.stdout.rsplit("LEFT ON THE FULL DISK ", 1) if "LEFT ON THE FULL DISK " in r.stdout else (r.stdout, "[]")
    assert json.loads(left) == [], left   # not even the write probe's file
    sys.stdout.write(out)
    sys.stderr.write(r.stderr)
    return r.returncode


def a_run_folder_holding(write: Callable[[Path], None]) -> Callable[[Ctx], list[str]]:
    """`cowtune train` resuming from run/checkpoint.pt, which ``write`` makes (no checkpoint.pt.prev beside it), in a
    folder an earlier run left as runs leave them (its lock file stays)."""
    def build(t: Ctx) -> list[str]:
        from trainables.trainer import RUN_LOCK
        (t.tmp / "run").mkdir()
        (t.tmp / "run" / RUN_LOCK).touch()
        write(t.tmp / "run" / "checkpoint.pt")
        return digits()(t)
    return build


def cut_short(path: Path) -> None:
    """A real checkpoint of digits' run (its config, weights, no steps), cut after 5,000 bytes as a crash mid-copy."""
    import io

    import torch
    buf = io.BytesIO()
    torch.save({"epoch": 1, "student": {"w": torch.zeros(4096)}}, buf)
    path.write_bytes(buf.getvalue()[:5000])


def torch_file_of(obj) -> Callable[[Path], None]:
    return lambda path: __import__("torch").save(obj, path)


ONE_LINE_RANGE = "must satisfy 0.001 <= low <= high"

CASES = [
    # cowtune train: the config
    Case("train-unknown-key", "cowtune", digits("train.epoch=2"),
         ("Unknown key in train 'epoch'.", "Did you mean 'epochs'?")),
    Case("train-unknown-top-level-key", "cowtune", digits("lr=0.1"), ("Unknown key in config 'lr'. Known: data, ",)),
    Case("train-prop-range-inverted", "cowtune", digits("mix.prop_range=0.8:0.2"),
         ("mix.prop_range must satisfy 0.0 <= low <= high <= 1.0, got (0.8, 0.2)",)),
    Case("train-sigma-zero", "cowtune", digits("mix.sigma_range=0:4"),
         (f"mix.sigma_range {ONE_LINE_RANGE}, got (0.0, 4.0)",)),
    Case("train-sigma-negative", "cowtune", digits("mix.sigma_range=-1:4"),
         (f"mix.sigma_range {ONE_LINE_RANGE}, got (-1.0, 4.0)",)),
    Case("train-sigma-three-numbers", "cowtune", digits("mix.sigma_range=4:16:32"),   # not YAML's base-60 15392
         ("mix.sigma_range must be a list of 2 numbers (LO:HI in --set), got '4:16:32'",)),
    Case("train-yaml-range-read-as-base-60", "cowtune",
         config_file("model: cnn_tiny\nmix: {name: cowmix, sigma_range: 4:16}\n", *sets("data.dataset=digits")),
         ("mix.sigma_range must be a list of 2 numbers (LO:HI in --set), got '4:16'",)),   # not 256
    Case("train-n-labeled-all", "cowtune", digits("data.n_labeled=all"),
         ("data.n_labeled must be an integer (-1 means all), got 'all'",)),
    Case("train-lr-infinite", "cowtune", digits("optim.lr_per_256=inf"),
         ("optim.lr_per_256 must be a finite number, got inf",)),
    Case("train-seed-negative", "cowtune", digits("seed=-1"),
         ("seed (or data.labeled_seed, which picks the labeled subset) must be between 0 and 2**32 - 1, got -1",)),
    Case("train-bn-batch-not-a-divisor", "cowtune", digits("train.batch_size=16", "train.bn_batch=5"),
         ("train.bn_batch must be null or an integer >= 2 that divides train.batch_size (16), got 5",)),
    Case("train-epochs-zero", "cowtune", digits("train.epochs=0"), ("train.epochs must be >= 1, got 0",)),
    Case("train-epochs-not-a-number", "cowtune", digits("train.epochs=abc"),
         ("train.epochs must be an integer, got 'abc'",)),
    Case("train-unknown-model", "cowtune", digits("model=wrn28_3"), ("Unknown model 'wrn28_3'.", "Did you mean")),
    Case("train-unknown-dataset", "cowtune", digits("data.dataset=cifar11"),
         ("Unknown dataset 'cifar11'.", "Did you mean 'cifar10'?")),
    Case("train-unknown-regularizer", "cowtune", digits("mix.name=cowmixx"),
         ("Unknown regularizer in mix.name 'cowmixx'.", "Did you mean 'cowmix'?")),
    Case("train-mixing-regularizer-as-perturb", "cowtune", digits("perturb.name=cowmix"),
         ("perturb.name must name an erasure regularizer, got 'cowmix'",)),
    Case("train-n-labeled-more-than-the-data", "cowtune", digits("data.n_labeled=5000"),
         ("data.n_labeled must be at most the 1497 images left after the validation holdout of 300", "got 5000")),
    Case("train-n-labeled-fewer-than-one-per-class", "cowtune", digits("data.n_labeled=5"),
         ("data.n_labeled must be at least the number of classes (10)", "got 5")),
    Case("train-n-val-the-whole-split", "cowtune", digits("data.n_val=1797"),
         ("data.n_val must be smaller than the training split (1797 images), got 1797",)),
    Case("train-n-val-fewer-than-the-classes", "cowtune", digits("data.n_val=5"),
         ("data.n_val must be 0 or at least the number of classes (10), got 5",)),
    Case("train-test-split-of-data-without-one", "cowtune", digits("data.eval_split=test"),
         ("data.eval_split must be 'val' for dataset 'digits' (it has no test split), got 'test'",)),
    Case("train-override-without-equals", "cowtune", digits("train.epochs"),
         ("--set takes key=value, got 'train.epochs'",)),
    Case("train-override-value-does-not-parse", "cowtune", digits("train.epochs=[1"),
         ("--set 'train.epochs=[1': the value does not parse as YAML or LO:HI: while parsing a flow sequence",
          "(line 1, column 3)")),
    Case("train-override-into-a-number", "cowtune", digits("train.epochs.max=3"),
         ("train.epochs must be a mapping to set 'train.epochs.max', got 8",)),
    Case("train-yaml-malformed", "cowtune", config_file("model: [cnn_tiny\n"),
         ("my.yaml is not valid YAML: while parsing a flow sequence, expected ',' or ']'", "(line 2, column 1)")),
    Case("train-yaml-not-a-mapping", "cowtune", config_file("- model\n- cnn_tiny\n"),
         ("my.yaml must hold a mapping of config fields, got list",)),
    Case("train-yaml-not-text", "cowtune", config_file(b"\x89PNG\r\n\x1a\n\xff\xfe\x00"),
         ("my.yaml is not a YAML file (not UTF-8 text)",)),
    Case("train-yaml-empty", "cowtune", config_file("# to fill in\n"),
         ("empty config file", "my.yaml: write the fields to change")),
    Case("train-yaml-key-twice", "cowtune", config_file("model: cnn_tiny\nmodel: wrn28_2\n"),
         ("my.yaml is not valid YAML: found the key 'model' twice (line 2, column 1)",)),
    Case("train-config-file-missing", "cowtune", lambda t: ["train", "nowhere/my.yaml", "--out", "run"],
         ("config file nowhere/my.yaml does not exist",)),
    Case("train-config-is-a-folder", "cowtune", lambda t: ["train", str(t.tree("tree")), "--out", "run"],
         ("is a folder: give a YAML file or a preset name",)),
    Case("train-unknown-preset", "cowtune", lambda t: ["train", "fsat", "--out", "run"],
         ("Unknown config preset 'fsat'.", "Did you mean 'fast'?")),
    Case("train-out-is-a-file", "cowtune", lambda t: digits(out=str(t.write("run", "a file")))(t),
         ("--out", "run is a file: give a folder")),
    Case("train-out-under-a-file", "cowtune", lambda t: digits(out=str(t.write("notes", "x") / "run"))(t),
         ("--out", "notes/run lies under the file", "give a folder")),
    Case("train-out-empty", "cowtune", digits(out=""), ("--out must name a folder, got ''",)),
    Case("train-out-cannot-be-made", "cowtune", digits(out="/proc/cowtune-run"),
         ("--out /proc/cowtune-run cannot be made",)),
    Case("train-out-in-use", "cowtune", out_in_use,
         ("a cowtune train into run is running already", "wait for it to end, or pass another --out")),
    # cowtune train: the data
    Case("train-torchvision-files-missing", "cowtune",
         lambda t: ["train", "fast", *sets("data.dataset=cifar10", f"data.root={t.tmp / 'cifar'}"), "--out", "run"],
         ("data.root must point at the cifar10 files in torchvision's layout (cifar-10-batches-py)",
          "`--set data.download=true`")),
    Case("train-data-root-missing", "cowtune", images(lambda t: t.tmp / "nowhere"),
         ("data.root must be an ImageFolder tree or a .zip of one", "nowhere' (not found)")),
    Case("train-data-empty-folder", "cowtune", images(lambda t: (t.tmp / "empty").mkdir() or t.tmp / "empty"),
         ("data.root must hold image files (.jpg, .jpeg, .png", "empty'")),
    Case("train-data-empty-zip", "cowtune", images(empty_zip),
         ("data.root must hold image files (.jpg, .jpeg, .png", "empty.zip'")),
    Case("train-data-zip-that-is-not-a-zip", "cowtune", images(lambda t: t.write("train.zip", "not a zip")),
         ("data.root must be an ImageFolder tree or a .zip of one", "(a file that is not a zip archive)")),
    Case("train-data-loose-images-no-class-folders", "cowtune",
         images(loose_images),
         ("data.root must hold images in class folders (<root>/<class>/<image>)",)),
    Case("train-data-test-class-missing-from-train", "cowtune", images(extra_test_class),
         ("data.root must have no test classes missing from train (zebra)",)),
    Case("train-data-truncated-jpeg", "cowtune",
         images(lambda t: _zip_with_a_truncated_jpeg(t.tmp / "bad.zip", per_class=6, bad="train/b/003.jpg")),
         ("holds an image that cannot be decoded, train/b/003.jpg (OSError", "remove or replace it")),
    Case("train-data-truncated-jpeg-first", "cowtune", images(truncated_first),
         ("holds an image that cannot be decoded, class0/000.jpg (OSError",)),
    Case("train-data-not-an-image", "cowtune", images(tree_with("class1/002.png", "just text")),
         ("holds an image that cannot be decoded, class1/002.png (UnidentifiedImageError",)),
    Case("train-data-not-an-image-first", "cowtune", images(tree_with("class0/000.png", "just text")),
         ("holds an image that cannot be decoded, class0/000.png (UnidentifiedImageError",)),
    Case("train-data-class-with-one-image", "cowtune", images(one_image_class),
         ("data.n_val must allow a stratified split of these labels, got 3", "only 1 member"), cached=True),
    Case("train-data-one-class", "cowtune", images(lambda t: t.tree("tree", classes=1)),
         ("tree' has one class folder (class0): training needs at least 2 classes",)),
    Case("train-data-one-class-zip", "cowtune",
         images(lambda t: _zip_tree(t.tree("tree", classes=1), t.tmp / "one.zip")),
         ("one.zip' has one class folder (class0): training needs at least 2 classes",)),
    Case("train-data-neither-folder-nor-file", "cowtune", images(lambda t: Path("/dev/null")),
         ("data.root must be an ImageFolder tree or a .zip of one, got '/dev/null' (neither a folder nor a file)",)),
    Case("train-data-symlink-loop", "cowtune", images(linked("class0/loop", "..")),
         ("holds a symbolic link loop: class0/loop leads back to the root; remove the link",)),
    Case("train-data-folder-linked-twice", "cowtune", images(linked("class2/more", "../class0")),
         ("holds one folder twice, as class0 and as class2/more (a link): its images would be read twice",)),
    Case("train-data-broken-symlink", "cowtune", images(linked("class1/zzz.png", "gone.png")),
         ("holds an image that cannot be decoded, class1/zzz.png (a broken symbolic link, to gone.png)",
          "--set data.unreadable=skip")),
    Case("train-data-broken-class-folder-link", "cowtune", images(linked("class3", "../elsewhere")),
         ("holds a broken symbolic link, class3 -> ../elsewhere (a class folder's?)",)),
    Case("train-data-float-image", "cowtune", images(tree_with("class1/zzz.tif", image=("F", (16, 16)))),
         ("holds an image of floats (mode F), class1/zzz.tif, whose range cannot be told",)),
    Case("train-data-mixed-sizes", "cowtune", images(tree_with("class1/zzz.png", image=("RGB", (20, 16)))),
         ("data.root must hold images of one size for the device pipeline (first is 16x16, class1/zzz.png is "
          "20x16); for mixed sizes use --set data.pipeline=loader --set data.image_size=20 --set data.workers=",)),
    Case("train-data-a-1x1-image", "cowtune", images(tree_with("class2/zzz.png", image=("RGB", (1, 1)))),
         ("data.root must hold images of one size", "class2/zzz.png is 1x1")),
    # the search script
    Case("search-no-trials", "search", search("--trials", "0"), ("--trials must be >= 1, got 0",)),
    Case("search-no-epochs", "search", search("--epochs", "0"), ("train.epochs must be >= 1, got 0",)),
    Case("search-trials-not-a-number", "search", search("--trials", "abc"),
         ("argument --trials: invalid int value: 'abc'",), usage=True),
    Case("search-unknown-preset", "search", lambda t: ["--preset", "fsat", "--storage", "ray"],
         ("Unknown config preset 'fsat'.", "Did you mean 'fast'?")),
    Case("search-data-missing", "search", lambda t: ["--data", "nowhere", "--storage", "ray"],
         ("--data must name an existing dataset folder or zip, got 'nowhere'",)),
    Case("search-data-empty-imagefolder", "search",
         lambda t: ["--data", str((t.tmp / "empty").mkdir() or t.tmp / "empty"), *sets("data.dataset=imagefolder"),
                    "--storage", "ray"],
         ("data.root must hold image files",)),
    # the search script: the data against the holdout and labels, before Ray (issue 54 items 2, 3)
    Case("search-data-smaller-than-the-holdout", "search",
         lambda t: ["--preset", "fast", "--data", str(t.tree("tree")), "--trials", "1", "--storage", "ray"],
         ("data.n_val must be smaller than the training split (18 images), got 5000",)),
    Case("search-labels-more-than-the-data", "search", search(*sets("data.n_labeled=5000")),
         ("data.n_labeled must be at most the 1597 images left after the validation holdout of 200", "got 5000")),
    Case("search-labels-fewer-than-the-classes", "search",
         lambda t: ["--preset", "fast", "--data", str(t.tree("tree")), *sets("data.n_val=3", "data.n_labeled=2"),
                    "--storage", "ray"],
         ("data.n_labeled must be at least the number of classes (3)", "got 2")),
    Case("search-data-class-with-one-image", "search",
         lambda t: ["--preset", "fast", "--data", str(one_image_class(t)), *sets("data.n_val=3", "data.n_labeled=6"),
                    "--storage", "ray"],
         ("data.n_val must allow a stratified split of these labels, got 3", "only 1 member")),
    Case("search-data-broken-symlink", "search",
         lambda t: ["--preset", "fast", "--data", str(linked("class1/zzz.png", "gone.png")(t)), "--storage", "ray"],
         ("holds an image that cannot be decoded, class1/zzz.png (a broken symbolic link, to gone.png)",)),
    Case("search-on-the-test-split", "search", search(*sets("data.eval_split=test")),
         ("data.eval_split must be 'val' with data.n_val > 0 in a search",)),
    Case("search-override-does-not-parse", "search", search(*sets("mix.weight={3")),
         ("--set 'mix.weight={3': the value does not parse as YAML or LO:HI",)),
    Case("search-storage-is-a-file", "search", lambda t: search(storage=str(t.write("ray", "a file")))(t),
         ("--storage", "ray is a file: give a folder")),
    Case("search-storage-under-a-file", "search", lambda t: search(storage=str(t.write("notes", "x") / "ray"))(t),
         ("--storage", "notes/ray lies under the file")),
    Case("search-tracking-server-unreachable", "search", unreachable_tracking(["--smoke-test", "--storage", "ray"]),
         ("(MLFLOW_TRACKING_URI) did not answer within 5 s", "Connection refused"), within_s=5.0),
    Case("search-optuna-storage-unreachable", "search",
         lambda t: search("--optuna-storage", f"postgresql+psycopg2://me:s3cret@127.0.0.1:{free_port()}/optuna")(t),
         ("the Optuna storage postgresql+psycopg2://me:***@127.0.0.1:", "could not be opened", "Connection refused"),
         within_s=10.0),
    Case("search-optuna-storage-not-a-url", "search", search("--optuna-storage", "optuna.db"),
         ("the Optuna storage optuna.db (COWTUNE_OPTUNA_STORAGE or --optuna-storage) could not be opened",)),
    Case("search-running-already", "search", search_running_already,
         ("wait for it to end, or pass --name NEW for another",)),
    # cowtune promote
    Case("promote-unknown-search", "cowtune", promote_from_a_store,
         ("Unknown search 'cifar10_cowmix' in sqlite:///", "Known: Default, e2e.")),
    Case("promote-no-tracking-store-here", "cowtune", lambda t: ["promote", "--search", "e2e", "--out", "p.yaml"],
         ("Unknown search 'e2e': there is no MLflow store at", "mlflow.db (no search was recorded there)")),
    Case("promote-out-is-a-folder", "cowtune",
         lambda t: ["promote", "--search", "e2e", "--out", str(t.tree("tree"))], ("--out", "tree is a folder")),
    Case("promote-out-under-a-file", "cowtune",
         lambda t: ["promote", "--search", "e2e", "--out", str(t.write("notes", "x") / "p.yaml")],
         ("--out", "notes/p.yaml lies under the file")),
    Case("promote-tracking-server-unreachable", "cowtune",
         unreachable_tracking(["promote", "--search", "e2e", "--out", "p.yaml"]),
         ("did not answer within 5 s",), within_s=5.0),
    # cowtune final
    Case("final-data-without-a-test-split", "cowtune", final("--datasets", "digits=unused", "--labels", "20"),
         ("dataset 'digits' (", "unused) has no test split to report")),   # the path as given, or resolved
    Case("final-imagefolder-without-a-test-split", "cowtune",
         lambda t: final("--datasets", f"imagefolder={t.tree('tree')}", "--labels", "6", "--seeds", "1")(t),
         ("dataset 'imagefolder' (", "has no test split to report")),
    # cowtune upload
    Case("upload-nothing-waits-there", "cowtune", lambda t: ["upload", str(t.write("empty/readme.txt", "x").parent)],
         ("no MLflow records wait in", "empty (a trial keeps them there when it ends while the tracking server does "
          "not answer)")),
    Case("final-batch-the-workers-cannot-split", "cowtune",
         final("--datasets", "cifar10=data", "--skip-data-check", "--ddp-workers", "3"),
         ("train.batch_size must be divisible by the 3 data-parallel workers that split it, got 256",)),
    Case("final-ghost-batch-wider-than-a-workers-slice", "cowtune",
         final("--datasets", "cifar10=data", "--skip-data-check", "--ddp-workers", "16", "--set", "train.bn_batch=32"),
         ("train.bn_batch must divide each of the 16 workers' 16 images of train.batch_size 256, got 32",)),
    Case("final-no-seeds", "cowtune", final("--datasets", "cifar10=data", "--seeds", "0"),
         ("--seeds must be >= 1, got 0",)),
    Case("final-config-missing", "cowtune",
         lambda t: ["final", "--config", "nowhere.yaml", "--datasets", "cifar10=data"],
         ("--config nowhere.yaml does not exist (write it with `cowtune promote`)",)),
    Case("final-config-malformed", "cowtune", final("--datasets", "cifar10=data", text="model: [cnn\n"),
         ("--config", "promoted.yaml is not valid YAML: while parsing a flow sequence",)),
    Case("final-datasets-malformed", "cowtune", final("--datasets", "cifar10"),
         ("argument --datasets: expected NAME=DIR[,NAME=DIR...], got 'cifar10'",), usage=True),
    Case("final-out-is-a-file", "cowtune",
         lambda t: ["final", "--config", promoted(t), "--datasets", "cifar10=data", "--out", promoted(t)],
         ("--out", "promoted.yaml is a file: give a folder")),
    # cowtune evaluate
    Case("evaluate-checkpoint-missing", "cowtune",
         lambda t: ["evaluate", "--checkpoint", "nowhere/checkpoint.pt", "--data", str(colour_tree(t))],
         ("--checkpoint must name a checkpoint.pt or the run folder holding it, got 'nowhere/checkpoint.pt' "
          "(not found)",)),
    Case("evaluate-not-a-checkpoint", "cowtune",
         lambda t: ["evaluate", "--checkpoint", str(t.write("notes.pt", "not a checkpoint")),
                    "--data", str(colour_tree(t))],
         ("--checkpoint must be a checkpoint written by `cowtune train`", "(not a PyTorch file")),
    Case("evaluate-class-folders-not-the-models", "cowtune", scored(lambda t: colour_tree(t, ("blue", "gren", "pink"))),
         ("--data must hold class folders named as the model's classes (blue, green, red), got 'gren' "
          "(did you mean 'green'?), 'pink'",)),
    Case("evaluate-not-an-image-first", "cowtune", scored(lambda t: colour_tree(t, bad=("blue/000.png", b"text"))),
         ("--data", "holds an image that cannot be decoded, test/blue/000.png (UnidentifiedImageError",)),
    Case("evaluate-truncated-jpeg", "cowtune", scored(lambda t: colour_tree(t, bad=("red/001.jpg", None))),
         ("--data", "holds an image that cannot be decoded, test/red/001.jpg (OSError",)),
    Case("evaluate-broken-symlink", "cowtune", scored(colour_tree_with_a_broken_link),
         ("--data", "holds an image that cannot be decoded, test/red/zzz.png (a broken symbolic link, to gone.png)",)),
    # cowtune masks
    Case("masks-sigma-zero", "cowtune", lambda t: ["masks", "--sigma", "0:4", "--out", "g.png"],
         (f"--sigma {ONE_LINE_RANGE}, got (0.0, 4.0)",)),
    Case("masks-sigma-inverted", "cowtune", lambda t: ["masks", "--sigma", "16:4", "--out", "g.png"],
         (f"--sigma {ONE_LINE_RANGE}, got (16.0, 4.0)",)),
    Case("masks-sigma-not-a-range", "cowtune", lambda t: ["masks", "--sigma", "4-16", "--out", "g.png"],
         ("argument --sigma: expected LO:HI, got '4-16'",), usage=True),
    Case("masks-too-many", "cowtune", lambda t: ["masks", "-n", "200000", "--out", "g.png"],
         ("-n must be 1..1024 and --size 2..1024, got n=200000, size=32",)),
    Case("masks-too-many-pixels", "cowtune", lambda t: ["masks", "-n", "1024", "--size", "1024", "--out", "g.png"],
         ("-n masks of --size px must hold at most 16,777,216 pixels in all", "got 1024 of 1024x1024")),
    Case("masks-sigma-infinite", "cowtune", lambda t: ["masks", "--sigma", "4:inf", "--out", "g.png"],
         ("argument --sigma: expected LO:HI of finite numbers, got '4:inf'",), usage=True),
    Case("masks-out-under-a-file", "cowtune",
         lambda t: ["masks", "--out", str(t.write("notes", "x") / "g.png"), "--npy", "m.npy"],
         ("--out", "notes/g.png lies under the file", "give a path in a folder")),
    # more inputs a new user tried (issue 54's "30 more of your own")
    Case("train-batch-size-zero", "cowtune", digits("train.batch_size=0"), ("train.batch_size must be >= 2, got 0",)),
    Case("train-lr-negative", "cowtune", digits("optim.lr_per_256=-0.1"), ("optim.lr_per_256 must be > 0, got -0.1",)),
    Case("train-teacher-alpha-above-one", "cowtune", digits("teacher.alpha=1.5"),
         ("teacher.alpha must be in [0, 1], got 1.5",)),
    Case("train-mix-weight-negative", "cowtune", digits("mix.weight=-1"), ("mix.weight must be >= 0, got -1.0",)),
    Case("train-prop-range-one-number", "cowtune", digits("mix.prop_range=0.2"),
         ("mix.prop_range must be a list of 2 numbers (LO:HI in --set), got 0.2",)),
    Case("train-sigma-range-one-item", "cowtune", digits("mix.sigma_range=[4]"),
         ("mix.sigma_range must have 2 items, got [4]",)),
    Case("train-sigma-range-not-numbers", "cowtune", digits("mix.sigma_range=a:b"),
         ("mix.sigma_range must be a list of 2 numbers (LO:HI in --set), got 'a:b'",)),
    Case("train-n-val-negative", "cowtune", digits("data.n_val=-3"), ("data.n_val must be >= 0, got -3",)),
    Case("train-n-labeled-zero", "cowtune", digits("data.n_labeled=0"),
         ("data.n_labeled must be >= 1 or -1 (all), got 0",)),
    Case("train-epochs-a-fraction", "cowtune", digits("train.epochs=2.5"), ("train.epochs must be an integer, got 2.5",)),
    Case("train-epochs-a-boolean", "cowtune", digits("train.epochs=true"),
         ("train.epochs must be an integer, got True",)),
    Case("train-model-empty", "cowtune", digits("model="), ("model must be a string, got None",)),
    Case("train-seed-a-float", "cowtune", digits("seed=1e20"), ("seed must be an integer, got 1e+20",)),
    Case("train-unknown-pipeline", "cowtune", digits("data.pipeline=gpu"),
         ("data.pipeline must be 'auto', 'device' or 'loader', got 'gpu'",)),
    Case("train-unknown-device", "cowtune", digits("train.device=tpu"),
         ("train.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'tpu'",)),
    Case("train-unknown-precision", "cowtune", digits("train.fast.precision=fp8"),
         ("train.fast.precision must be 'auto', 'fp32' or 'bf16', got 'fp8'",)),
    Case("train-dataset-empty", "cowtune", digits("data.dataset="), ("data.dataset must be a string, got None",)),
    Case("train-erasure-regularizer-as-mix", "cowtune", digits("mix.name=cowout"),
         ("mix.name must name a mixing regularizer, got 'cowout'",)),
    Case("train-unknown-unreadable-policy", "cowtune", digits("data.unreadable=ignore"),
         ("data.unreadable must be 'stop' or 'skip', got 'ignore'",)),
    Case("train-confidence-above-one", "cowtune", digits("mix.conf_thresh=2"), ("mix.conf_thresh must be < 1, got 2.0",)),
    Case("train-steps-per-epoch-negative", "cowtune", digits("train.steps_per_epoch=-1"),
         ("train.steps_per_epoch must be >= 1 or null, got -1",)),
    Case("train-loader-workers-negative", "cowtune", digits("data.workers=-2"), ("data.workers must be >= 0, got -2",)),
    Case("train-image-size-zero", "cowtune", digits("data.image_size=0"),
         ("data.image_size must be >= 8 or null, got 0",)),
    Case("train-yaml-section-not-a-mapping", "cowtune", config_file("model: cnn_tiny\ntrain: 3\n"),
         ("train must be a mapping, got 3",)),
    Case("train-yaml-tab-indented", "cowtune", config_file("model: cnn_tiny\ntrain:\n\tepochs: 3\n"),
         ("my.yaml is not valid YAML: while scanning for the next token, found character '\\t' that cannot start any "
          "token (line 3, column 1)",)),
    Case("train-yaml-sigma-range-inverted", "cowtune",
         config_file("mix: {name: cowmix, sigma_range: [16, 4]}\n", *sets("data.dataset=digits")),
         (f"mix.sigma_range {ONE_LINE_RANGE}, got (16.0, 4.0)",)),
    Case("train-resume-from-a-checkpoint-cut-short", "cowtune", a_run_folder_holding(cut_short),
         ("run/checkpoint.pt cannot be read (cut short (Invalid argument)) and there is no previous checkpoint to go "
          "back to; pass --restart to start over",)),
    Case("train-resume-from-a-torch-file-not-a-checkpoint", "cowtune", a_run_folder_holding(torch_file_of([1, 2, 3])),
         ("run/checkpoint.pt is not a checkpoint written by cowtune (a PyTorch file holding a list); move it away, or "
          "pass --restart to start over",)),
    Case("search-concurrency-zero", "search", search("--concurrency", "0"),
         ("--concurrency must be >= 1 (leave it out for as many as the resources allow), got 0",)),
    Case("search-name-empty", "search", search("--name", ""),
         ("--name must be one word of letters, digits, '.', '_' or '-' (it names a folder and an MLflow experiment), "
          "got ''",)),
    Case("search-name-with-a-slash", "search", search("--name", "team/exp1"), ("--name must be one word", "'team/exp1'")),
    Case("search-name-escaping-the-storage", "search", search("--name", "../escape"),
         ("--name must be one word", "'../escape'")),
    Case("search-storage-empty", "search", lambda t: ["--smoke-test", "--storage", ""],
         ("--storage must name a folder or a URI (leave it out for ./ray_results), got ''",)),
    Case("search-cpus-per-trial-zero", "search", search("--cpus-per-trial", "0"), ("--cpus-per-trial must be >= 1, got 0",)),
    Case("search-gpu-share-above-one", "search", search("--gpu-share", "3"), ("--gpu-share must be in (0, 1], got 3.0",)),
    Case("search-no-finalists", "search", search("--finalists", "0"), ("--finalists must be >= 1, got 0",)),
    Case("search-unknown-key", "search", search(*sets("train.epoch=3")),
         ("Unknown key in train 'epoch'.", "Did you mean 'epochs'?")),
    Case("search-config-file-missing", "search", lambda t: ["--preset", "nowhere.yaml", "--storage", "ray"],
         ("config file nowhere.yaml does not exist",)),
    Case("search-erasure-regularizer-as-mix", "search", search(*sets("mix.name=cowout")),
         ("mix.name must name a mixing regularizer, got 'cowout'",)),
    Case("final-seeds-negative", "cowtune", final("--datasets", "cifar10=data", "--seeds", "-1"),
         ("--seeds must be >= 1, got -1",)),
    Case("final-no-labels", "cowtune", final("--datasets", "cifar10=data", "--labels", "0"),
         ("data.n_labeled must be >= 1 or -1 (all), got 0",)),
    Case("final-labels-not-numbers", "cowtune", final("--datasets", "cifar10=data", "--labels", "abc"),
         ("argument --labels: expected comma-separated label counts (or 'all'), got 'abc'",), usage=True),
    Case("final-dataset-without-a-folder", "cowtune", final("--datasets", "cifar10="),
         ("argument --datasets: expected NAME=DIR[,NAME=DIR...], got 'cifar10='",), usage=True),
    Case("final-unknown-key", "cowtune", final("--datasets", "cifar10=data", "--set", "train.epoch=3"),
         ("Unknown key in train 'epoch'.", "Did you mean 'epochs'?")),
    Case("final-name-with-a-slash", "cowtune", final("--datasets", "cifar10=data", "--name", "a/b"),
         ("--name must be one word", "got 'a/b'")),
    Case("final-unknown-dataset", "cowtune", final("--datasets", "cifar11=data"),
         ("Unknown dataset 'cifar11'.", "Did you mean 'cifar10'?")),
    Case("final-no-data-parallel-workers", "cowtune", final("--datasets", "cifar10=data", "--ddp-workers", "0"),
         ("--ddp-workers must be >= 1 (GPUs per run), got 0",)),
    Case("final-more-cpus-per-run-than-cores", "cowtune",
         final("--datasets", "cifar10=data", "--cpus-per-trial", "4096"),
         ("--cpus-per-trial must be at most this machine's", "(Ray would wait for them for ever), got 4096")),
    Case("masks-p-inverted", "cowtune", lambda t: ["masks", "--p", "0.9:0.1", "--out", "g.png"],
         ("--p must satisfy 0.0 <= low <= high <= 1.0, got (0.9, 0.1)",)),
    Case("masks-p-above-one", "cowtune", lambda t: ["masks", "--p", "0:2", "--out", "g.png"],
         ("--p must satisfy 0.0 <= low <= high <= 1.0, got (0.0, 2.0)",)),
    Case("masks-size-one", "cowtune", lambda t: ["masks", "--size", "1", "--out", "g.png"],
         ("-n must be 1..1024 and --size 2..1024, got n=32, size=1",)),
    Case("masks-none", "cowtune", lambda t: ["masks", "-n", "0", "--out", "g.png"],
         ("-n must be 1..1024 and --size 2..1024, got n=0, size=32",)),
    Case("masks-box-scale-above-one", "cowtune",
         lambda t: ["masks", "--kind", "box", "--box-mode", "fixed", "--box-scale", "2", "--out", "g.png"],
         ("--box-scale must be in [0, 1], got 2.0",)),
    Case("masks-npy-under-a-file", "cowtune",
         lambda t: ["masks", "--out", "g.png", "--npy", str(t.write("notes", "x") / "m.npy")],
         ("--npy", "notes/m.npy lies under the file", "give a path in a folder")),
    Case("masks-out-a-folder", "cowtune", lambda t: ["masks", "--out", str(t.tmp)], ("--out", "is a folder: give a file name")),
    Case("evaluate-batch-size-zero", "cowtune",
         lambda t: ["evaluate", "--checkpoint", checkpoint(t), "--data", str(colour_tree(t)), "--batch-size", "0"],
         ("--batch-size must be >= 1, got 0",)),
    Case("evaluate-json-under-a-file", "cowtune",
         lambda t: ["evaluate", "--checkpoint", checkpoint(t), "--data", str(colour_tree(t)),
                    "--json", str(t.write("notes", "x") / "r.json")],
         ("--json must be a file in an existing folder, got", "notes/r.json")),
    Case("evaluate-data-an-image", "cowtune",
         lambda t: ["evaluate", "--checkpoint", checkpoint(t), "--data", str(colour_tree(t) / "test" / "blue" / "000.png")],
         ("--data must be a folder or .zip of class folders (or of train/ and test/)", "(neither a folder nor a .zip)")),
    Case("evaluate-one-class-folder", "cowtune",
         lambda t: ["evaluate", "--checkpoint", checkpoint(t), "--data", str(colour_tree(t) / "test" / "blue")],
         ("--data must hold images in class folders (<class>/<image>, or test/<class>/<image>)",)),
    Case("evaluate-checkpoint-without-weights", "cowtune",
         lambda t: ["evaluate", "--checkpoint", str(a_torch_file(t, {"config": {}, "epoch": 1})),
                    "--data", str(colour_tree(t))],
         ("--checkpoint must be a checkpoint written by `cowtune train`", "(a PyTorch file without student, teacher)")),
    # every output on a full disk: refused before any work (a 64 KiB write probe; an empty file fits on a full disk)
    Case("train-out-on-a-full-disk", "cowtune", digits(out=f"{FULL}/run"),
         (f"--out {FULL}/run cannot be made (No space left on device)",), full_disk=True),
    Case("train-out-the-full-disk-itself", "cowtune", digits(out=FULL),
         (f"--out {FULL} cannot be written (No space left on device)",), full_disk=True),
    Case("search-storage-on-a-full-disk", "search", search(storage=f"{FULL}/ray"),
         (f"--storage {FULL}/ray cannot be made (No space left on device)",), full_disk=True),
    Case("final-out-on-a-full-disk", "cowtune",
         lambda t: ["final", "--config", promoted(t), "--datasets", "cifar10=data", "--out", f"{FULL}/fin"],
         (f"--out {FULL}/fin cannot be made (No space left on device)",), full_disk=True),
    Case("final-storage-on-a-full-disk", "cowtune",
         lambda t: ["final", "--config", promoted(t), "--datasets", "cifar10=data", "--storage", f"{FULL}/ray"],
         (f"--storage {FULL}/ray cannot be made (No space left on device)",), full_disk=True),
    Case("promote-out-on-a-full-disk", "cowtune", lambda t: ["promote", "--search", "e2e", "--out", f"{FULL}/p.yaml"],
         (f"--out {FULL}/p.yaml: its folder cannot be written (No space left on device)",), full_disk=True),
    Case("masks-out-on-a-full-disk", "cowtune", lambda t: ["masks", "--out", f"{FULL}/g.png"],
         (f"--out {FULL}/g.png: its folder cannot be written (No space left on device)",), full_disk=True),
    Case("evaluate-json-on-a-full-disk", "cowtune",
         lambda t: ["evaluate", "--checkpoint", checkpoint(t), "--data", str(colour_tree(t)), "--json", f"{FULL}/r.json"],
         (f"--json {FULL}/r.json: its folder cannot be written (No space left on device)",), full_disk=True),
    Case("train-out-on-a-read-only-disk", "cowtune", digits(out=f"{FULL}/run"),
         (f"--out {FULL}/run cannot be made: ", f"/{FULL} is not writable (a read-only file system)"), full_disk="ro"),
    Case("search-storage-on-a-read-only-disk", "search", search(storage=f"{FULL}/ray"),
         (f"--storage {FULL}/ray cannot be made: ", f"/{FULL} is not writable (a read-only file system)"), full_disk="ro"),
    Case("evaluate-json-is-a-folder", "cowtune",
         lambda t: ["evaluate", "--checkpoint", checkpoint(t), "--data", str(colour_tree(t)), "--json", str(t.tmp)],
         ("--json", "is a folder: give a file name")),
    Case("train-decode-unknown", "cowtune", digits("data.decode=gpu"),
         ("data.decode must be 'auto', 'pil', 'device' or 'hybrid', got 'gpu'",)),
    Case("train-cpu-fraction-above-one", "cowtune", digits("data.decode=hybrid", "data.cpu_fraction=1.5"),
         ("data.cpu_fraction must be in [0, 1] or null, got 1.5",)),
    Case("train-cpu-fraction-negative", "cowtune", digits("data.decode=hybrid", "data.cpu_fraction=-0.1"),
         ("data.cpu_fraction must be in [0, 1] or null, got -0.1",)),
    Case("train-cpu-fraction-not-a-number", "cowtune", digits("data.decode=hybrid", "data.cpu_fraction=most"),
         ("data.cpu_fraction must be a number, got 'most'",)),
    Case("train-cpu-fraction-without-hybrid", "cowtune", digits("data.decode=device", "data.cpu_fraction=0.5"),
         ("data.cpu_fraction must be null unless data.decode is 'hybrid' (data.decode is 'device'), got 0.5",)),
    Case("train-hybrid-decode-of-in-memory-images", "cowtune", digits("data.pipeline=loader", "data.decode=hybrid"),
         ("data.decode must be 'auto' or 'pil' for dataset 'digits' (its images are in memory, not files to decode), "
          "got 'hybrid'",)),
]


# ------------------------------------------------------------------------------------------------ running

@pytest.fixture(scope="module")
def nothing_starts():
    """Whatever comes after the checks (a model built to train, MLflow's experiment opened, Ray started, the
    compile-ahead process) fails the case instead of happening."""
    import ray

    import trainables.search.compile_ahead
    import trainables.search.driver
    import trainables.search.experiments
    import trainables.search.final
    import trainables.trainer

    def started(what: str):
        def refuse(*args, **kwargs):
            raise AssertionError(f"a bad input got past its checks: {what}")
        return refuse

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainables.trainer, "build_runner", started("a model was built to train"))
        mp.setattr(ray, "init", started("Ray started"))
        mp.setattr(trainables.search.experiments, "init_ray", started("Ray started"))
        for module in (trainables.search.driver, trainables.search.final):
            mp.setattr(module, "open_experiment", started("the MLflow experiment was opened"))
        mp.setattr(trainables.search.compile_ahead, "start", started("the compile-ahead process started"))
        yield


def files_under(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if CACHE not in p.relative_to(root).parts}


def invoke(case: Case, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int | str | None:
    try:
        if case.cmd == "cowtune":
            return main(argv)
        monkeypatch.setattr(sys, "argv", [str(SCRIPT), *argv])
        runpy.run_path(str(SCRIPT), run_name="__main__")
        return 0
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_in_one_line_leaving_nothing(case, tmp_path, monkeypatch, capsys, request,
                                                          nothing_starts):
    monkeypatch.chdir(tmp_path)   # ./mlflow.db, ./ray_results and runs/ would land here
    monkeypatch.setenv("COWTUNE_CACHE", str(tmp_path / CACHE))
    for name in ("MLFLOW_TRACKING_URI", "COWTUNE_STORAGE", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    ctx = Ctx(tmp_path, monkeypatch, request.addfinalizer)
    if case.full_disk:
        if not full_disk_cases_can_run():
            pytest.skip("no user and mount namespace here (unshare -rm) to mount a full tmpfs in")
        (tmp_path / FULL).mkdir()
    argv = case.build(ctx)
    before = files_under(tmp_path)
    capsys.readouterr()

    t0 = time.monotonic()
    code = invoke_on_a_full_disk(case, argv, tmp_path, capsys) if case.full_disk else invoke(case, argv, monkeypatch)
    elapsed = time.monotonic() - t0
    out, err = capsys.readouterr()

    assert "Traceback" not in out + err, err
    assert code == 2, (code, err)
    lines = err.splitlines()
    prog = ("cowtune " + argv[0] if case.cmd == "cowtune" else SCRIPT.name) if case.usage else \
        ("cowtune" if case.cmd == "cowtune" else SCRIPT.stem)
    if case.usage:   # argparse: its usage block (wrapped lines indented), then the one error line
        assert lines[0].startswith(f"usage: {prog} ") and all(line.startswith(" ") for line in lines[1:-1]), err
    else:
        assert len(lines) == 1, err
    assert lines[-1].startswith(f"{prog}: error: "), err
    for part in (*case.expect, *ctx.expect):
        assert part in lines[-1], f"{part!r} not in {lines[-1]!r}"
    if case.within_s is not None:
        assert elapsed < case.within_s, elapsed

    assert files_under(tmp_path) == before   # nothing written: no run folder, checkpoint, mlflow.db, ray_results
    cache = [p.name for p in (tmp_path / CACHE).glob("*") if not p.name.endswith(".lock")]
    assert all(n.endswith(".npz") and ".tmp." not in n for n in cache) if case.cached else not cache, cache


def test_the_table_covers_every_command_and_kind_of_input():
    assert len(CASES) >= 32 and len({c.id for c in CASES}) == len(CASES)
    commands = {c.id.split("-")[0] for c in CASES}
    assert commands == {"train", "search", "promote", "final", "evaluate", "masks", "upload"}


# ------------------------------------------------------------------------------------------------ beyond the table

def test_a_16_bit_png_is_scaled_to_8_bits_not_clipped(tmp_path, monkeypatch):
    """A 16-bit greyscale PNG (PIL's mode I;16) is read as v / 257 by both pipelines, and by the decoder they and
    `cowtune evaluate` share (``image_decode.decode_range``, also in its worker processes, from a folder or a zip):
    PIL's convert("RGB") clips it, which made 99.5% of such an image's pixels 255."""
    import numpy as np
    from PIL import Image

    from trainables import data as D
    from trainables.config import DataConfig

    monkeypatch.setenv("COWTUNE_CACHE", str(tmp_path / CACHE))
    _write_tree(tmp_path / "tree", 3, 6, 16, False)
    ramp = np.arange(256, dtype=np.uint16).reshape(16, 16)
    Image.fromarray(ramp * 257).save(tmp_path / "tree" / "class0" / "000.png")
    assert Image.open(tmp_path / "tree" / "class0" / "000.png").mode == "I;16"
    raw = D.load_raw(DataConfig(dataset="imagefolder", root=str(tmp_path / "tree")))
    assert all(np.array_equal(raw.train_images[0][..., c], ramp) for c in range(3))
    files = D.load_raw(DataConfig(dataset="imagefolder", root=str(tmp_path / "tree"), pipeline="loader")).train_images
    assert np.array_equal(np.asarray(files.load(0)), raw.train_images[0])

    from trainables.data.image_decode import decode_images, decode_range
    names = [p.relative_to(tmp_path / "tree").as_posix() for p in sorted((tmp_path / "tree").rglob("*.png"))]
    assert names[0] == "class0/000.png"
    for root in (tmp_path / "tree", _zip_tree(tmp_path / "tree", tmp_path / "tree.zip")):
        one, bad = decode_range(str(root), names[:1], (16, 16))
        many, bad_many = decode_images(str(root), names, (16, 16), workers=2)   # two worker processes
        assert bad is None and bad_many is None
        assert all(np.array_equal(a[0][..., c], ramp) for a in (one, many) for c in range(3))


FILLS_UP = """
import contextlib, io, json, os, shutil, subprocess, sys
from pathlib import Path
import torch
from trainables.cli import main
argv, run, PAGE = json.loads(sys.argv[1]), Path("full/run"), 4096
def used():
    st = os.statvfs("full")
    return (st.f_blocks - st.f_bfree) * st.f_frsize
def remount(size):
    subprocess.run(["mount", "-o", f"remount,size={size}", "full"], check=True)
assert main(argv) == 0
need = used() - 2 * PAGE   # the run's lock, config and checkpoint; not its metrics and result (a page each)
shutil.rmtree(run)
seen = []
for extra in (-1, 0, 1):   # the checkpoint, then the metrics, then the result meet the full disk
    remount(need + extra * PAGE)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    files = sorted(p.name for p in run.iterdir())
    whole = {p.name: (torch.load(p, weights_only=True)["epoch"] if p.suffix == ".pt" else
                      [json.loads(x) for x in p.read_text().splitlines()] if p.suffix == ".jsonl" else
                      json.loads(p.read_text())) for p in run.iterdir() if p.suffix in (".pt", ".jsonl", ".json")}
    remount("64m")
    with contextlib.redirect_stdout(io.StringIO()):
        resumed = main(argv)   # the same command, once there is space
    seen.append({"code": code, "err": err.getvalue(), "files": files, "checkpoint": whole.get("checkpoint.pt"),
                 "resumed": resumed, "after": sorted(p.name for p in run.iterdir()),
                 "metrics_after": len((run / "metrics.jsonl").read_text().splitlines())})
    shutil.rmtree(run)
print(json.dumps(seen))
"""


def test_a_disk_that_fills_mid_run_is_named_and_nothing_is_left_half_written(tmp_path):
    """`cowtune train` whose --out disk fills up (a tmpfs in a namespace of the test's own: the kernel's ENOSPC, no
    privilege needed) while the checkpoint, then the metrics, then the result are written, one page less room each
    time: each says "no space left on device" and the file in one line (not PyTorch's "unexpected pos N vs M"), no
    temporary file stays, every file there reads whole, and the same command then finishes the run."""
    if not full_disk_cases_can_run():
        pytest.skip("no user and mount namespace here (unshare -rm) to mount a tmpfs in")
    (tmp_path / "full").mkdir()
    argv = digits("train.epochs=1", "train.steps_per_epoch=1", out="full/run")(None)
    r = on_a_tmpfs(tmp_path / "full", "size=64m", [sys.executable, "-c", FILLS_UP, json.dumps(argv)], cwd=tmp_path,
                   timeout=300, env={**os.environ, "COWTUNE_CACHE": str(tmp_path / CACHE)})
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.splitlines()[-1])
    kept = "the last checkpoint, full/run/checkpoint.pt, is intact"
    expected = [("the checkpoint full/run/checkpoint.pt", "no checkpoint was written yet"),
                ("full/run/metrics.jsonl", kept), ("full/run/result.json", kept)]
    for s, (what, last) in zip(seen, expected):
        assert s["code"] == 1 and s["err"].splitlines() == [
            f"cowtune: error: no space left on device for --out full/run (writing {what}); {last}: free space and "
            "run the same command to resume"], s
        assert not [f for f in s["files"] if f.endswith(".tmp")], s
        assert s["checkpoint"] == (None if "no checkpoint" in last else 1), s
        assert s["resumed"] == 0 and {"checkpoint.pt", "metrics.jsonl", "result.json"} <= set(s["after"]), s
        assert s["metrics_after"] == 1, s


def test_the_default_out_folder_holds_a_hash_of_the_overrides():
    """Without --out, two runs of one config with other --set items do not share a folder; the same items do."""
    from trainables.cli import default_out

    assert default_out("fast", "cowmix", 0, []) == Path("runs/fast-cowmix-seed0")   # as before
    one = default_out("my.yaml", "cowmix", 0, ["train.epochs=3"])
    assert one.parent == Path("runs") and one.name.startswith("my-cowmix-seed0-") and len(one.name) == 24
    assert default_out("my.yaml", "cowmix", 0, ["train.epochs=3"]) == one
    assert default_out("my.yaml", "cowmix", 0, ["train.epochs=4"]) != one


def test_evaluate_says_when_it_scores_the_runs_own_training_images(tmp_path, monkeypatch, capsys):
    """--data the run's data.root, scored whole (it has no test/ split): one line says these are training images."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COWTUNE_CACHE", str(tmp_path / CACHE))
    ctx = Ctx(tmp_path, monkeypatch, lambda f: None)
    tree = colour_tree(ctx) / "test"   # blue/, green/, red/: every class folder scored
    assert main(["evaluate", "--checkpoint", checkpoint(ctx, str(tree), weights=True), "--data", str(tree),
                 "--device", "cpu", "--json", "r.json"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "training data" in line]
    assert notes == [f"note: {tree} is the run's own training data (its data.root), every class folder scored: it "
                     "trained on these images, so this is no test error"]
    assert json.loads((tmp_path / "r.json").read_text())["training_images"] is True


@pytest.mark.slow
def test_a_config_error_in_a_trial_is_said_once_and_not_trained_again(search_env, tmp_path):
    """A trial whose data only its worker checks (--skip-data-check: 18 images, the smoke test's holdout of 200)
    fails with a ConfigError. Ray retries every failure (max_failures 2), but the attempt it queues stops at once
    with the same message, before reading the data; the search exits 1 with the message on its last line, and no
    traceback is printed."""
    _write_tree(tmp_path / "tree", 3, 6, 16, False)
    out = subprocess.run([sys.executable, str(SCRIPT), "--smoke-test", "--trials", "1", "--name", "cfgerr",
                          "--data", str(tmp_path / "tree"), "--set", "data.dataset=imagefolder", "--skip-data-check",
                          "--no-confirm", "--no-compile-ahead", "--storage", str(tmp_path / "ray")],
                         env=search_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    message = "data.n_val must be smaller than the training split (18 images), got 200"
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.splitlines()[-1] == (f"cfgerr: error: every trial failed (1 of 1); the first: "
                                           f"trainables.validation.ConfigError: {message}"), out.stderr[-3000:]
    assert "Traceback" not in out.stdout + out.stderr, out.stderr[-3000:]
    assert "Ray runs it again" not in out.stdout
    errors = list((tmp_path / "ray").glob("cfgerr/*/error.txt"))
    failures = [line for line in errors[0].read_text().splitlines() if line.startswith("Failure # ")]
    assert len(errors) == 1 and len(failures) == 2, failures   # not 3: the retry stopped at once, and was the last


@pytest.mark.slow
def test_a_search_whose_storage_fills_up_ends_in_one_line_naming_it(tmp_path):
    """A search whose --storage is a 3 MiB disk (a tmpfs in a namespace of its own, local Ray): the first trial's
    checkpoints fit, the second's do not. Ray's own errors of it aside, the driver's last line says that the storage
    filled up and how to resume, exit status 1; not a traceback of Ray's truncated error file."""
    if not full_disk_cases_can_run():
        pytest.skip("no user and mount namespace here (unshare -rm) to mount a tmpfs in")
    (tmp_path / "full").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "COWTUNE_STORAGE")}
    env.update(COWTUNE_CACHE=str(tmp_path / CACHE), PYTHONUNBUFFERED="1")
    r = on_a_tmpfs(tmp_path / "full", "size=3m", [sys.executable, str(SCRIPT), "--smoke-test", "--trials", "2", "--no-confirm",
                                              "--no-compile-ahead", "--name", "fills", "--storage", "full/ray"],
                   cwd=tmp_path, env=env, timeout=900)   # about 130 s alone, 300-450 s on 2 busy cores
    last = r.stderr.splitlines()[-1]
    assert r.returncode == 1 and last == (f"fills: error: --storage {tmp_path / 'full' / 'ray'} filled up (No space "
                                          "left on device): free space there and run the same command to resume"), last
    assert "UnpicklingError" not in r.stderr and "No space left on device" in r.stdout   # the table named it too
