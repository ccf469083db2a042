"""Every search file is short, declarative, valid before Ray starts, and never reads the test split."""
import ast
import importlib
import random
from pathlib import Path

import pytest
import torch

from trainables.search import intervals
from trainables.search.intervals import Choice, Float, Interval
from trainables.search.plan import SearchSettings, parse_args, prepare_search
from trainables.search.trial import HoldoutOnly, train_trial
from trainables.validation import ConfigError

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted(p for p in (ROOT / "search_spaces").glob("*.py") if p.name != "__init__.py")


def load(path):
    return importlib.import_module(f"search_spaces.{path.stem}")


def test_the_required_searches_exist():
    assert {"cifar10_cowmix.py", "cifar10_cowout.py"} <= {p.name for p in FILES}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_search_file_is_short_and_declarative(path):
    text = path.read_text()
    assert len(text.splitlines()) <= 40
    roots = {n.module.split(".")[0] for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ImportFrom)}
    roots |= {a.name.split(".")[0] for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Import) for a in n.names}
    assert roots <= {"trainables"}, roots
    mod = load(path)
    assert mod.BASE.data.eval_split == "val" and mod.BASE.data.n_val == 5000


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
@pytest.mark.parametrize("argv", [[], ["--smoke-test"], ["--preset", "fast", "--trials", "3", "--epochs", "2", "--data", "x.zip"]])
def test_search_prepares_on_the_driver_with_paper_point_first(path, argv, tmp_path, monkeypatch):
    mod = load(path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.zip").write_bytes(b"")
    plan = prepare_search(mod.BASE, mod.SPACE, mod.SEARCH, parse_args(mod.SEARCH, argv))
    assert plan.base["data"]["eval_split"] == "val"
    first = intervals.decode(mod.SPACE, plan.points[0])        # the paper's setting, decoded back
    section = "mix" if "mix" in mod.SPACE else "perturb"
    assert first[section]["sigma_range"] == pytest.approx(plan.base[section]["sigma_range"])
    assert first[section]["prop_range"] == pytest.approx(plan.base[section]["prop_range"])
    assert 1 <= plan.grace <= plan.epochs
    if argv and argv[0] == "--preset":
        assert plan.base["model"] == "cnn_tiny" and plan.num_samples == 3
        assert plan.base["data"]["root"] == str(tmp_path / "x.zip")   # absolute: trials run in other folders


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
@pytest.mark.parametrize("override", ["data.eval_split=test", "data.n_val=0"])
def test_no_search_can_evaluate_on_the_test_split(path, override):
    mod = load(path)
    with pytest.raises(ConfigError, match="eval_split"):
        prepare_search(mod.BASE, mod.SPACE, mod.SEARCH, parse_args(mod.SEARCH, ["--set", override]))


@pytest.mark.parametrize("argv, key", [(["--trials", "0"], "--trials"), (["--epochs", "0"], "train.epochs"),
                                       (["--trials", "-2"], "--trials"),
                                       (["--set", "model=wrn28_3"], "Unknown model 'wrn28_3'"),
                                       (["--name", "team/exp1"], "--name must be one word"),
                                       (["--name", "../escape"], "--name must be one word"),
                                       (["--cpus-per-trial", "4096"], "--cpus-per-trial must be at most"),
                                       (["--cpus-per-trial", "0"], "--cpus-per-trial must be >= 1"),
                                       (["--gpu-share", "1.5"], "--gpu-share must be in"),
                                       (["--confirm-seeds", "2"], "--confirm-seeds must be >= 3"),
                                       (["--finalists", "0"], "--finalists must be >= 1")])
def test_zero_or_negative_counts_and_unknown_names_are_refused_before_ray(argv, key):
    mod = load(FILES[0])
    with pytest.raises(ConfigError, match=key):
        prepare_search(mod.BASE, mod.SPACE, mod.SEARCH, parse_args(mod.SEARCH, argv))


def test_a_space_that_could_pick_the_test_split_is_refused():
    mod = load(FILES[0])
    space = {**mod.SPACE, "data": {"eval_split": Choice(("val", "test"))}}
    with pytest.raises(ConfigError, match="test"):
        prepare_search(mod.BASE, space, SearchSettings(name="x", validation_samples=32), parse_args(mod.SEARCH, []))


def test_trials_refuse_the_test_split_even_if_asked():
    cfg = load(FILES[0]).BASE.to_dict()
    cfg["data"].update(eval_split="test", n_val=0)
    with pytest.raises(ConfigError, match="eval_split"):
        train_trial({**cfg, "_cowtune": {"mode": "search"}})
    from trainables.config import DataConfig
    from trainables.data import prepare_data
    tree_data = prepare_data(DataConfig(dataset="digits", n_val=100, n_labeled=20), 0, torch.device("cpu"))
    guarded = HoldoutOnly(tree_data)
    assert next(iter(guarded.eval_batches("val", 50)))[0].shape[0] == 50
    with pytest.raises(ConfigError, match="test split"):
        guarded.eval_batches("test", 50)


@pytest.mark.parametrize("dom", [Interval(1.0, 32.0, log=True, min_width=1.5), Interval(0.0, 1.0, min_width=0.1)])
def test_interval_samples_are_never_empty_or_inverted(dom):
    specs = dom.params("r")
    rng = random.Random(0)
    corners = [{k: s[1] for k, s in specs.items()}, {k: s[2] for k, s in specs.items()}]
    for values in corners + [{k: rng.uniform(s[1], s[2]) for k, s in specs.items()} for _ in range(500)]:
        lo, hi = dom.decode(values, "r")
        assert dom.low - 1e-9 <= lo < hi <= dom.high + 1e-9
        assert (hi / lo if dom.log else hi - lo) >= dom.min_width - 1e-6


def test_interval_round_trip_and_errors():
    dom = Interval(1.0, 32.0, log=True, min_width=1.5)
    assert dom.decode(dom.encode([4.0, 16.0], "s"), "s") == pytest.approx([4.0, 16.0])
    with pytest.raises(ConfigError, match="inside"):
        dom.encode([16.0, 4.0], "s")
    with pytest.raises(ConfigError, match="min_width"):
        Interval(0.0, 1.0, min_width=0.0)
    with pytest.raises(ConfigError, match="low < high"):
        Float(2.0, 1.0)
    with pytest.raises(ConfigError, match="Float, Choice or Interval"):
        intervals.space_params({"mix": {"weight": (1, 2)}})



def test_data_that_a_trial_could_not_read_fails_on_the_driver(tmp_path):
    """A JPEG zip passed for the torchvision cifar10 layout is refused before Ray, with the fix named."""
    import zipfile

    from trainables.search.plan import check_files

    mod = load(FILES[0])
    archive = tmp_path / "train.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("airplane/0.jpg", b"listed, not decoded")
        z.writestr("bird/0.jpg", b"listed, not decoded")   # two classes: one class alone is refused as such
    (tmp_path / "empty").mkdir()

    def plan(*argv):
        return prepare_search(mod.BASE, mod.SPACE, mod.SEARCH, parse_args(mod.SEARCH, list(argv)))

    def check(*argv):
        check_files(plan(*argv), parse_args(mod.SEARCH, list(argv)))

    with pytest.raises(ConfigError, match=r"add `--set data\.dataset=imagefolder`"):
        check("--data", str(archive))
    with pytest.raises(ConfigError, match=r"cifar-10-batches-py.*data\.download=true"):
        check("--data", str(tmp_path / "empty"))
    check("--data", str(archive), "--set", "data.dataset=imagefolder")   # readable: no error
    check("--data", str(tmp_path / "empty"), "--skip-data-check")        # only the workers hold the data


def test_grace_period_counts_the_images_of_an_imagefolder_zip(tmp_path):
    """The grace rule's steps per epoch come from the real number of training images (here 600 in a zip,
    batch 64, holdout 88: 8 steps), not from a guess for an unknown dataset."""
    import zipfile

    from trainables.config import TrainConfig
    from trainables.search.plan import grace_rule

    archive = tmp_path / "train.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for i in range(600):
            z.writestr(f"c{i % 3}/{i}.png", b"")
    base = TrainConfig.from_dict({"data": {"dataset": "imagefolder", "root": str(archive), "n_val": 88,
                                           "eval_split": "val"}, "train": {"batch_size": 64}})
    space = {"teacher": {"alpha": Float(0.9, 0.99)}}
    # H = 1 / ((1 - 0.99) * 8) = 12.5 epochs; 3 H = 37.5 -> 38 (under a 100-epoch budget)
    assert grace_rule(base, space, 100) == 38
    assert grace_rule(base, space, 20) == 20


def test_the_confirm_stage_takes_fresh_seeds_and_the_objective_is_recorded():
    mod = load(FILES[0])
    plan = prepare_search(mod.BASE, mod.SPACE, mod.SEARCH, parse_args(mod.SEARCH, ["--confirm-seeds", "5"]))
    assert plan.confirm.seeds == (1, 2, 3, 4, 5) and plan.tags["cowtune.objective"] == "val/error_teacher_mean3"
    assert plan.grace == 150                                    # half of the 300-epoch budget (min_rung=0.5)
    assert prepare_search(mod.BASE, mod.SPACE, mod.SEARCH, parse_args(mod.SEARCH, ["--no-confirm"])).confirm is None
    with pytest.raises(ConfigError, match="not include the search trials' seed 3"):
        prepare_search(mod.BASE, mod.SPACE, mod.SEARCH, parse_args(mod.SEARCH, ["--set", "seed=3"]))
