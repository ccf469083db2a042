"""The trainer on real (small) data: every method steps, gradients go where they should, resume is exact."""
import json
import math
import re
import time

import pytest
import torch

from trainables import metrics as M
from trainables.config import TrainConfig
from trainables.data import prepare_data
from trainables.models import create_model
from trainables.optim import make_optimizer
from trainables.ssl.ema import make_teacher
from trainables.step import StepRunner, train_step
from trainables.trainer import fit
from trainables.validation import ConfigError, TrainingDiverged

METHODS = {
    "supervised": {},
    "mean_teacher": {"perturb": {"name": "mean_teacher", "conf_thresh": 0.0}},
    "randerase": {"perturb": {"name": "randerase"}},
    "cowout": {"perturb": {"name": "cowout"}},
    "ict": {"mix": {"name": "ict"}},
    "cutmix": {"mix": {"name": "cutmix"}},
    "cowmix": {"mix": {"name": "cowmix"}},
    "cowout+cowmix": {"perturb": {"name": "cowout"}, "mix": {"name": "cowmix"}},
}


def tiny_config(method="cowmix", **train):
    d = {
        "seed": 0, "model": "cnn_tiny",
        "data": {"dataset": "digits", "n_val": 200, "n_labeled": 30},
        "optim": {"lr_per_256": 0.5, "schedule": "constant"},
        "train": {"batch_size": 16, "epochs": 1, "steps_per_epoch": 3, "eval_batch_size": 256,
                  "device": "cpu", **train},
        **METHODS[method],
    }
    return TrainConfig.from_dict(d)


@pytest.fixture(scope="module")
def digits():
    return prepare_data(tiny_config().data, labeled_seed=0, device=torch.device("cpu"))


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_trains_and_reports(method, digits, tmp_path):
    cfg = tiny_config(method)
    assert cfg.method == method
    reports = []
    result = fit(cfg, tmp_path, data=digits, report=lambda e, m, p: reports.append((e, m, p)), log=lambda s: None)
    assert [e for e, _, _ in reports] == [1]
    final = result["final"]
    for key in (M.LOSS_SUP, M.VAL_ERROR_TEACHER, M.VAL_ERROR_STUDENT, M.LR, M.IMAGES_PER_S):
        assert math.isfinite(final[key]), key
    assert (M.LOSS_MIX in final) == (cfg.mix is not None)
    assert (M.LOSS_CONS in final) == (cfg.perturb is not None)
    assert (tmp_path / "checkpoint.pt").exists() and (tmp_path / "result.json").exists()
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])[M.EPOCH] == 1


@pytest.mark.parametrize("method", [m for m in METHODS if m != "supervised"])
def test_unlabeled_loss_trains_student_not_teacher(method, digits):
    cfg = tiny_config(method)
    torch.manual_seed(0)
    student = create_model(cfg.model, digits.num_classes)
    teacher = make_teacher(student)
    # let every sample pass the confidence threshold so the unlabeled loss is non-zero
    import dataclasses
    for key in ("perturb", "mix"):
        path = getattr(cfg, key)
        if path is not None:
            cfg = dataclasses.replace(cfg, **{key: dataclasses.replace(path, conf_thresh=0.0)})
    runner = StepRunner(cfg, student, teacher, make_optimizer(student, cfg.optim, 16), torch.device("cpu"), False)
    batch = next(iter(digits.train_batches(0, 0, 16, 1, cfg.perturb is not None and
                                           cfg.perturb.regularizer.augment_twice)))
    unlabeled = dataclasses.replace(batch, x_sup=None, y_sup=None)   # the step without its supervised part
    train_step(runner, runner.kernels, unlabeled, torch.Generator().manual_seed(0), 0.1, 0.97, runner.numbers)
    losses = [runner.sums[k].item() for k in (M.LOSS_CONS, M.LOSS_MIX) if k in runner.sums]
    assert losses and all(v > 0 for v in losses) and runner.sums[M.LOSS_SUP].item() == 0
    unl_norm = sum(float(p.grad.norm()) for p in student.parameters() if p.grad is not None)
    assert unl_norm > 0, "the unlabeled loss sends no gradient to the student"
    assert all(p.grad is None for p in teacher.parameters()), "the teacher got a gradient"
    assert all(not p.requires_grad for p in teacher.parameters())


def test_resume_is_bit_exact(digits, tmp_path):
    cfg = tiny_config("cowout+cowmix", epochs=3)
    fit(cfg, tmp_path / "straight", data=digits, log=lambda s: None)

    class Stop(Exception):
        pass

    def die_after_first(epoch, metrics, path):
        if epoch == 1:
            raise Stop

    with pytest.raises(Stop):
        fit(cfg, tmp_path / "resumed", data=digits, report=die_after_first, log=lambda s: None)
    logs = []
    fit(cfg, tmp_path / "resumed", data=digits, log=logs.append)
    assert any("resumed from" in line and "epoch 1" in line for line in logs)
    a = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=False)
    assert a["epoch"] == b["epoch"] == 3
    for part in ("student", "teacher"):
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), f"{part}.{k} differs after resume"
    assert [h[M.VAL_ERROR_TEACHER] for h in a["history"]] == [h[M.VAL_ERROR_TEACHER] for h in b["history"]]


def test_resume_with_shake_shake_gates_is_bit_exact(tmp_path):
    cfg = TrainConfig.from_dict({**tiny_config("cowmix", epochs=2, steps_per_epoch=2, batch_size=4).to_dict(),
                                 "model": "wrn26_2_shakeshake"})
    data = prepare_data(cfg.data, 0, torch.device("cpu"))
    fit(cfg, tmp_path / "a", data=data, log=lambda s: None)

    def die(epoch, metrics, path):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fit(cfg, tmp_path / "b", data=data, report=die, log=lambda s: None)
    fit(cfg, tmp_path / "b", data=data, log=lambda s: None)
    a = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)["student"]
    b = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["student"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_same_seed_same_result_other_seed_differs(digits, tmp_path):
    r1 = fit(tiny_config("cowmix"), tmp_path / "1", data=digits, log=lambda s: None)["final"]
    r2 = fit(tiny_config("cowmix"), tmp_path / "2", data=digits, log=lambda s: None)["final"]
    assert r1[M.LOSS_MIX] == r2[M.LOSS_MIX] and r1[M.LOSS_SUP] == r2[M.LOSS_SUP]
    cfg3 = TrainConfig.from_dict({**tiny_config("cowmix").to_dict(), "seed": 1})
    r3 = fit(cfg3, tmp_path / "3", data=digits, log=lambda s: None)["final"]
    assert r3[M.LOSS_SUP] != r1[M.LOSS_SUP]


def test_checkpoint_from_another_config_is_refused(digits, tmp_path):
    fit(tiny_config("cowmix"), tmp_path, data=digits, log=lambda s: None)
    other = TrainConfig.from_dict({**tiny_config("cowmix").to_dict(), "mix": {"name": "cowmix", "weight": 5.0}})
    with pytest.raises(ConfigError, match=r"different config \(differs in: mix.weight\)"):
        fit(other, tmp_path, data=digits, log=lambda s: None)
    # a longer run of the same config may continue from it
    longer = tiny_config("cowmix", epochs=2)
    with pytest.raises(ConfigError, match="train.epochs"):
        fit(longer, tmp_path, data=digits, log=lambda s: None)


@pytest.mark.parametrize("key, value, match", [("model", "wrn28_3", "Unknown model 'wrn28_3'.*wrn28_2"),
                                               ("dataset", "cifar11", "Unknown dataset 'cifar11'.*cifar10")])
def test_a_misspelt_name_is_named_before_a_checkpoint_is_compared(digits, tmp_path, key, value, match):
    fit(tiny_config("cowmix"), tmp_path / "run", data=digits, log=lambda s: None)
    d = tiny_config("cowmix").to_dict()
    if key == "model":
        d["model"] = value
    else:
        d["data"]["dataset"] = value
    with pytest.raises(ConfigError, match=match):   # not "a different config (differs in: model)"
        fit(TrainConfig.from_dict(d), tmp_path / "run", log=lambda s: None)
    with pytest.raises(ConfigError, match=match):
        fit(TrainConfig.from_dict(d), tmp_path / "new", log=lambda s: None)
    assert not (tmp_path / "new").exists()


def test_missing_data_leaves_no_output_folder(tmp_path):
    d = tiny_config().to_dict()
    d["data"].update(dataset="imagefolder", root=str(tmp_path / "nowhere.zip"))
    with pytest.raises(ConfigError, match="nowhere.zip"):
        fit(TrainConfig.from_dict(d), tmp_path / "out", log=lambda s: None)
    assert not (tmp_path / "out").exists()


def test_bad_split_fails_before_training(tmp_path):
    cfg = TrainConfig.from_dict({**tiny_config().to_dict(), "data": {"dataset": "digits", "n_val": 200,
                                                                       "n_labeled": 5000}})
    with pytest.raises(ConfigError, match="data.n_labeled"):
        fit(cfg, tmp_path, log=lambda s: None)
    assert not (tmp_path / "checkpoint.pt").exists()


def test_epochs_report_where_their_time_went(digits, tmp_path):
    cfg = tiny_config("cowmix", epochs=2)
    reports, lines = [], []
    fit(cfg, tmp_path, data=digits, report=lambda e, m, p: reports.append(dict(m)), log=lines.append)
    first, second = reports
    for m in (first, second):
        assert m[M.TRAIN_S] > 0 and m[M.EVAL_S] > 0 and m[M.CHECKPOINT_S] > 0
    # the first step (compilation and tuning on a GPU) is reported once, in the epoch that ran it
    assert first[M.FIRST_STEP_S] > 0 and first[M.COMPILE_WAIT_S] == 0.0   # on CPU no lock is taken
    assert M.FIRST_STEP_S not in second and M.COMPILE_WAIT_S not in second
    assert sum(line.strip().startswith("first step") for line in lines) == 1


def test_packed_trials_take_turns_for_their_steps_but_not_their_first(digits, tmp_path, monkeypatch):
    import tempfile
    import threading

    from trainables.fast.gpu_turns import gpu_turn
    from trainables.trainer import train_epoch
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))      # where gpu_turn keeps its lock files
    cfg = tiny_config("cowmix", steps_per_epoch=4)
    torch.manual_seed(0)
    student = create_model(cfg.model, digits.num_classes)
    runner = StepRunner(cfg, student, make_teacher(student), make_optimizer(student, cfg.optim, 16),
                        torch.device("cpu"), False)
    out = {}
    with gpu_turn("gpu0"):                                       # another trial has the GPU
        worker = threading.Thread(target=lambda: out.update(train_epoch(cfg, runner, digits, 0, 4, 0.1, turn="gpu0")))
        worker.start()
        deadline = time.monotonic() + 60
        while runner.count < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        # the first step (compilation on a GPU) ran without the turn; the others wait for it
        time.sleep(1.2)
        assert worker.is_alive() and runner.count == 1
    worker.join(timeout=60)
    assert runner.count == 4 and out[M.TURN_WAIT_S] >= 1.0
    again = train_epoch(cfg, runner, digits, 1, 4, 0.1, turn="gpu0")  # free turn: all four steps in it
    assert again[M.TURN_WAIT_S] < 0.5 and M.FIRST_STEP_S not in again
    assert M.TURN_WAIT_S not in train_epoch(cfg, runner, digits, 2, 4, 0.1)   # not packed: no turns


def test_result_names_the_best_epoch_beside_the_last(digits, tmp_path):
    result = fit(tiny_config("cowmix", epochs=3), tmp_path, data=digits, log=lambda s: None)
    history = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    best = min(history, key=lambda h: h[M.VAL_ERROR_TEACHER])
    assert result["best"] == {M.EPOCH: best[M.EPOCH], M.VAL_ERROR_TEACHER: best[M.VAL_ERROR_TEACHER]}
    assert json.loads((tmp_path / "result.json").read_text())["best"] == result["best"]


def test_a_loss_that_becomes_nan_stops_the_run_with_its_reason(digits, tmp_path):
    """A learning rate far too large: the losses go NaN in the first epoch. The run stops there, naming the loss,
    the epoch and what to change, instead of training on to a silent 90% error."""
    d = tiny_config("cowmix", epochs=3).to_dict()
    d["optim"]["lr_per_256"] = 1e12
    with pytest.raises(TrainingDiverged, match=r"the training loss became nan \(train/loss_sup\).* in epoch 1; the "
                                               r"run stopped: lower optim.lr_per_256 \(1e\+12\)"):
        fit(TrainConfig.from_dict(d), tmp_path, data=digits, log=lambda s: None)
    assert not (tmp_path / "checkpoint.pt").exists() and not (tmp_path / "result.json").exists()


CAPPED = """import resource, sys
import trainables.trainer
from trainables.cli import main
vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (vm + 1500 * 2**20, resource.RLIM_INFINITY))   # the kernel refuses the rest
sys.exit(main(sys.argv[1:]))
"""


def test_running_out_of_memory_stops_the_run_in_one_line_naming_what_to_lower(tmp_path):
    """A real allocation failure: the process's address space capped by the kernel (RLIMIT_AS) 1.5 GB above what
    it has mapped, and a batch whose activations need more. `cowtune train` exits 1 with one line naming the
    device, the epoch and the batch size, not a traceback from inside the step; no checkpoint claims the epoch."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sets = ["model=cnn_tiny", "data.dataset=digits", "data.n_val=200", "data.n_labeled=50", "data.eval_split=val",
            "train.batch_size=16384", "train.bn_batch=null", "train.steps_per_epoch=2", "train.epochs=1",
            "train.threads=1", "train.device=cpu"]
    out = subprocess.run([sys.executable, "-c", CAPPED, "train", "cifar10_cowmix", "--out", str(tmp_path / "run"),
                          *[a for s in sets for a in ("--set", s)]],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    (line,) = out.stderr.strip().splitlines()
    assert re.fullmatch(r"cowtune: error: out of memory on cpu in epoch 1 \(training: DefaultCPUAllocator: can't "
                        r"allocate memory: you tried to allocate \d+ bytes\. Error code 12 \(Cannot allocate memory\)\); "
                        r"the run stopped: lower train\.batch_size \(16384\), or choose a smaller model than cnn_tiny",
                        line), line
    assert not (tmp_path / "run" / "checkpoint.pt").exists() and not (tmp_path / "run" / "result.json").exists()


GPU_CAPPED = """import sys, torch
from trainables.cli import main
torch.cuda.set_per_process_memory_fraction(2**30 / torch.cuda.get_device_properties(0).total_memory)   # 1 GiB
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")
def test_running_out_of_gpu_memory_stops_the_run_in_one_line(tmp_path):
    """The same on a GPU, on the default fast path (compiled, CUDA graphs): PyTorch's allocator capped at 1 GiB of
    the device, a WRN-28-2 batch of 4096 needs several. One line naming cuda, the epoch and the batch size."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sets = ["model=wrn28_2", "data.dataset=digits", "data.n_val=200", "data.n_labeled=50", "data.eval_split=val",
            "train.batch_size=4096", "train.steps_per_epoch=2", "train.epochs=1", "train.fast.tune_kernels=false"]
    out = subprocess.run([sys.executable, "-c", GPU_CAPPED, "train", "cifar10_cowmix", "--out", str(tmp_path / "run"),
                          *[a for s in sets for a in ("--set", s)]],
                         cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, out.stderr[-3000:]
    (line,) = [x for x in out.stderr.strip().splitlines() if x.startswith("cowtune")] or [out.stderr[-3000:]]
    assert re.fullmatch(r"cowtune: error: out of memory on cuda(:0)? in epoch 1 \(training: .*\); the run stopped: "
                        r"lower train\.batch_size \(4096\), or choose a smaller model than wrn28_2; trials packed on "
                        r"one GPU share its memory \(the search's GPUs per trial\)", line), out.stderr[-3000:]
    assert len(out.stderr.strip().splitlines()) <= 3, out.stderr[-3000:]   # no traceback (a warning or two at most)
    assert not (tmp_path / "run" / "checkpoint.pt").exists() and not (tmp_path / "run" / "result.json").exists()


def test_a_checkpoint_written_before_a_config_field_existed_still_resumes(digits, tmp_path):
    """A run checkpointed by an older cowtune (its config lacks data.unreadable, added since) resumes: the new
    field's default is what it ran with; a field that really differs is still refused."""
    cfg = tiny_config("cowmix", epochs=1)
    fit(cfg, tmp_path, data=digits, log=lambda s: None)
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    del ckpt["config"]["data"]["unreadable"]
    torch.save(ckpt, tmp_path / "checkpoint.pt")
    said = []
    fit(cfg, tmp_path, data=digits, log=said.append)
    assert any(s.startswith("resumed from") for s in said)
    with pytest.raises(ConfigError, match=r"differs in: data.unreadable"):
        fit(TrainConfig.from_dict({**cfg.to_dict(), "data": {**cfg.to_dict()["data"], "unreadable": "skip"}}),
            tmp_path, data=digits, log=lambda s: None)
