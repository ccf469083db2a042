"""Train one configuration on one device, evaluate every epoch, checkpoint, resume exactly.

``fit(cfg, out_dir, report=...)`` is the whole public surface. It knows nothing of Ray or
MLflow: callers observe it through ``report(epoch, metrics, checkpoint_path)``, called once per
epoch after the checkpoint is on disk.

Randomness: model initialisation draws from ``torch.manual_seed(seed)``. At the start of every
epoch each stream is re-derived from (seed, epoch): the data order and augmentation (inside
``TrainData.train_batches``), the mask generator, and the global torch RNG (shake-shake gates,
dropout). A run resumed from an epoch checkpoint therefore continues bit-for-bit, and the
checkpoint still records every RNG state for inspection.
"""
from __future__ import annotations

import contextlib
import json
import math
import re
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from trainables import checkpoints
from trainables import metrics as M
from trainables.config import TrainConfig
from trainables.data import TrainData, check_dataset, data_record, prepare_data, stream_seed
from trainables.fast.switch import FastSwitches, fast_path, gpu_identity, gpu_turn
from trainables.file_locks import job_lock
from trainables.legacy_checkpoints import upgrade_optimizer_state
from trainables.models import check_model, create_model
from trainables.optim import lr_factor, make_optimizer, step_schedule
from trainables.ssl.ema import make_teacher
from trainables.step import StepRunner, evaluate
from trainables.validation import ConfigError, RunOutOfMemory, TrainingDiverged

CHECKPOINT = "checkpoint.pt"
# Fields that may change between a run and its resume: where and how fast it runs, not what it computes
# (compile modes, CUDA graphs and stacked student calls may pick other kernels: results agree to rounding,
# not bit for bit).
RESUME_FREE = ("train.device", "train.threads", "train.eval_batch_size",
               *(f"train.fast.{k}" for k in ("compile", "compile_mode", "cuda_graph", "stack_student_calls",
                                             "gpu_turns", "conv_kernels", "wgrad_stream", "combo_kernels",
                                             "dependent_launch", "tune_kernels", "compile_masks_and_losses")),
               "data.workers", "data.root", "data.download")

Report = Callable[[int, dict[str, float], Path], None]
TUNED_NOTE = " (kernels tuned: a step's first compile on a machine takes minutes more, later ones load it)"


def _print(line: str) -> None:
    print(line, flush=True)  # progress must show up when stdout is a file or a pipe


def resolve_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(setting)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device must name an available device, got {setting!r} (no CUDA here)")
    return device


def autotune_convolutions() -> None:
    """cuDNN times every algorithm it has for each convolution shape at its first call and keeps the
    fastest, instead of only the 10 its heuristics rank first (``benchmark_limit`` 10, PyTorch's default): timing
    them all made the step faster (measured: docs/journal/2026-11-26.md)."""
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.benchmark_limit = 0


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def config_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    fa, fb = _flat(a), _flat(b)
    keys = sorted(set(fa) | set(fb))
    return [k for k in keys if fa.get(k) != fb.get(k) and k not in RESUME_FREE]


def _with_new_fields(config: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's config with the fields added to TrainConfig since it was written, at their defaults (which
    are what it ran with); as it is when it no longer loads."""
    try:
        return TrainConfig.from_dict(config).to_dict()
    except ConfigError:
        return config


def _fmt_time(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def _summary(epoch: int, epochs: int, m: dict[str, float], split: str, eta: float) -> str:
    parts = [f"epoch {epoch}/{epochs}", f"sup {m[M.LOSS_SUP]:.3f}"]
    if M.LOSS_CONS in m:
        parts.append(f"cons {m[M.LOSS_CONS]:.4f} conf {m[M.CONF_RATE]:.2f}")
    if M.LOSS_MIX in m:
        parts.append(f"mix {m[M.LOSS_MIX]:.4f} conf {m[M.MIX_CONF_RATE]:.2f}")
    parts.append(f"lr {m[M.LR]:.4f}")
    parts.append(f"{split} err teacher {100 * m[M.eval_key(split, 'error', 'teacher')]:.2f}% "
                 f"student {100 * m[M.eval_key(split, 'error', 'student')]:.2f}%")
    parts.append(f"{m[M.IMAGES_PER_S]:.0f} img/s")
    parts.append(f"ETA {_fmt_time(eta)}")
    return " | ".join(parts)


def check_finite(metrics: dict[str, float], epoch: int, cfg: TrainConfig) -> None:
    """Raises TrainingDiverged if an epoch's mean training loss is NaN or infinite (one step's is enough: the
    epoch's sums carry it), instead of going on to a silent 90% error."""
    bad = {k: v for k, v in metrics.items() if k.startswith("train/loss") and not math.isfinite(v)}
    if bad:
        raise TrainingDiverged(
            f"the training loss became {', '.join(f'{v} ({k})' for k, v in bad.items())} in epoch {epoch}; the run "
            f"stopped{f' with its last checkpoint (epoch {epoch - 1}) kept' if epoch > 1 else ''}: lower optim.lr_per_256 "
            f"({cfg.optim.lr_per_256:g}) or the loss weights, or add optim.warmup_epochs")


CPU_ALLOCATOR_FAILURE = "can't allocate memory"   # PyTorch's CPU allocator, when the system refuses an allocation


@contextlib.contextmanager
def out_of_memory_stops(cfg: TrainConfig, device: torch.device, epoch: int, what: str):
    """Turns a device's out-of-memory error in ``what`` (training or evaluation) into RunOutOfMemory: one message
    naming the device, the epoch and the settings that size the memory, in place of a traceback from the middle
    of a step (PyTorch's CUDA out-of-memory error, or its CPU allocator's failure)."""
    try:
        yield
    except RuntimeError as exc:
        if not isinstance(exc, torch.OutOfMemoryError) and CPU_ALLOCATOR_FAILURE not in str(exc):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        first = re.sub(r"^\[enforce fail at [^\]]*\] (err == 0\. )?", "", first)   # the CPU allocator's prefix
        size = (f"train.eval_batch_size ({cfg.train.eval_batch_size})" if what == "evaluation"
                else f"train.batch_size ({cfg.train.batch_size})")
        raise RunOutOfMemory(
            f"out of memory on {device} in epoch {epoch} ({what}: {first[:200]}); the run stopped"
            f"{f' with its last checkpoint (epoch {epoch - 1}) kept' if epoch > 1 else ''}: lower {size}, or choose a "
            f"smaller model than {cfg.model}" + ("; trials packed on one GPU share its memory (the search's "
                                                 "GPUs per trial)" if device.type == "cuda" else "")) from None


def best_epoch(history: list[dict[str, float]], key: str) -> dict[str, float]:
    """The epoch with the lowest ``key`` and its value (for instability: the run's result is its last epoch)."""
    scored = [h for h in history if key in h]
    if not scored:
        return {}
    best = min(scored, key=lambda h: h[key])
    return {M.EPOCH: best[M.EPOCH], key: best[key]}


def train_epoch(cfg: TrainConfig, runner: StepRunner, data: TrainData, epoch: int, steps_per_epoch: int,
                base_lr: float, stream: int | None = None, log: Callable[[str], None] | None = None,
                turn: str | None = None, shard: tuple[int, int] = (0, 1)) -> dict[str, float]:
    """Run one epoch of steps; return its training metrics (means), learning rate, epoch and step.

    The epoch's random streams are re-derived first: the global torch RNG from (seed, epoch) (shake-shake
    gates, dropout), the data order and augmentation from (seed, epoch), the masks from (``stream``, epoch).
    Data-parallel training passes ``shard = (rank, world)``: the worker's slice of each of ``train.batch_size``
    images (``TrainData.train_batches``), and its own ``stream`` for the masks. ``log`` gets a progress line every 15 s.
    ``turn``: the GPU this process shares with other trials; the steps then run in its turn
    (``trainables.fast.gpu_turns``), all but a run's first step, which compiles and must not hold the GPU idle.
    """
    stream = cfg.seed if stream is None else stream
    torch.manual_seed(stream_seed(cfg.seed, epoch, "model"))
    gen = runner.generator.manual_seed(stream_seed(stream, epoch, "masks"))
    runner.reset_metrics()
    augment_twice = cfg.perturb is not None and cfg.perturb.regularizer.augment_twice
    first = runner.first_step is None
    waited: dict[str, float] = {}
    t0 = t_print = time.monotonic()
    with contextlib.ExitStack() as turns:
        batches = data.train_batches(epoch, cfg.seed, cfg.train.batch_size, steps_per_epoch, augment_twice, shard)
        for i, batch in enumerate(batches):
            if turn is not None and i == int(first):
                waited = turns.enter_context(gpu_turn(turn))
            runner.step(batch, gen, *step_schedule(cfg, epoch * steps_per_epoch + i, steps_per_epoch, base_lr))
            if first and i == 0 and log is not None:
                wait = runner.first_step[M.COMPILE_WAIT_S]
                log(f"  first step {runner.first_step[M.FIRST_STEP_S]:.1f} s"
                    + (" (compilation, cuDNN tuning and graph capture)" if runner.compiled else "")
                    + (f", after {wait:.1f} s waiting for another process's compilation" if wait >= 0.5 else ""))
            if log is not None and time.monotonic() - t_print > 15:
                t_print = time.monotonic()
                rate = (i + 1) / (t_print - t0)
                log(f"  epoch {epoch + 1} step {i + 1}/{steps_per_epoch} | {rate:.1f} steps/s | "
                    f"epoch ETA {_fmt_time((steps_per_epoch - i - 1) / rate)}")
        metrics = runner.read_metrics()   # waits for the epoch's GPU work: then the turn passes on
    if first:
        metrics.update(runner.first_step)
    if waited:
        metrics[M.TURN_WAIT_S] = waited["waited_s"]
    metrics[M.LR] = base_lr * lr_factor((epoch + 1) * steps_per_epoch - 1, steps_per_epoch, cfg.optim)
    metrics[M.EPOCH], metrics[M.STEP] = epoch + 1, (epoch + 1) * steps_per_epoch
    return metrics


def setup_device(cfg: TrainConfig) -> torch.device:
    """The run's device, with its CPU threads and cuDNN algorithm choice set as ``cfg`` asks."""
    device = resolve_device(cfg.train.device)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    choose_convolutions(cfg, device)
    return device


def choose_convolutions(cfg: TrainConfig, device: torch.device) -> None:
    """cuDNN's algorithm choice as ``cfg`` asks: deterministic, or the fastest of all it has on a GPU."""
    if cfg.train.deterministic:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    elif device.type == "cuda":
        autotune_convolutions()


def build_runner(cfg: TrainConfig, num_classes: int, device: torch.device,
                 grad_sync: Callable[[nn.Module], None] | None = None,
                 switches: FastSwitches | None = None) -> StepRunner:
    """Student (initialised from ``cfg.seed``), teacher, optimiser and the step that trains them: the plain step, made
    fast by ``FastStep`` unless ``train.fast.enabled`` is false (``grad_sync``: a data-parallel worker's,
    ``StepRunner``'s; ``switches``: the fast path's A/B switches, a benchmark's, ``fast_path``'s)."""
    torch.manual_seed(cfg.seed)
    fast = fast_path(cfg, switches)   # None: the plain step
    student = create_model(cfg.model, num_classes).to(device)
    if fast is not None:
        fast.prepare_student(student, cfg, device)   # fast blocks, our convolution kernels, weight-gradient stream
    if cfg.train.fast.channels_last and device.type == "cuda":
        student = student.to(memory_format=torch.channels_last)
    teacher = make_teacher(student)
    optimizer = make_optimizer(student, cfg.optim, cfg.train.batch_size)
    return StepRunner(cfg, student, teacher, optimizer, device, cfg.train.fast.bf16(device.type), grad_sync,
                      fast.step if fast is not None else None)


def check_names(cfg: TrainConfig) -> None:
    """The model and the dataset ``cfg`` names are registered; raises ConfigError with the closest known names."""
    check_model(cfg.model)
    check_dataset(cfg.data.dataset)


def fit(cfg: TrainConfig, out_dir: str | Path, report: Report | None = None, data: TrainData | None = None,
        log: Callable[[str], None] = _print, restart: bool = False, shared_gpu: bool = False,
        keep_previous: bool = True, lock: bool = False) -> dict[str, Any]:
    """Train ``cfg`` and return the final metrics; resumes from ``out_dir/checkpoint.pt`` if present.
    ``shared_gpu``: other trials are packed on this GPU; with ``train.fast.gpu_turns`` the epochs take turns.
    ``lock`` (``cowtune train``): hold the folder's lock (``RUN_LOCK``) while training, from before the checkpoint
    is read when the folder exists, else from when it is made; searches and finals lock their own folders.

    Raises:
        ConfigError: bad config (an unknown model or dataset is named first, before any checkpoint is read or
            folder made), bad data split, a checkpoint made with a different config, or (``lock``) another
            process training into ``out_dir``, named.
    """
    with contextlib.ExitStack() as held:
        return _fit(cfg, Path(out_dir), report, data, log, restart, shared_gpu, keep_previous,
                    held if lock else None)


RUN_LOCK = ".cowtune-train.lock"


def _hold_folder(held: contextlib.ExitStack | None, out: Path) -> None:
    if held is not None:
        held.enter_context(job_lock(out / RUN_LOCK, f"a cowtune train into {out}", "pass another --out"))


def _fit(cfg: TrainConfig, out: Path, report: Report | None, data: TrainData | None, log: Callable[[str], None],
         restart: bool, shared_gpu: bool, keep_previous: bool, held: contextlib.ExitStack | None) -> dict[str, Any]:
    check_names(cfg)                  # a misspelt name is named as such, not as a checkpoint's other config
    existed = out.is_dir()
    if existed:
        _hold_folder(held, out)       # a second run into it is refused before it reads the checkpoint or the data
    ckpt_path = out / CHECKPOINT
    resume = None
    if ckpt_path.exists() and not restart:
        resume = checkpoints.load(ckpt_path, log)   # tensors and plain data only; a damaged one: the epoch before
        diff = config_differences(_with_new_fields(resume["config"]), cfg.to_dict())
        if diff:
            raise ConfigError(f"{ckpt_path} was made with a different config (differs in: {', '.join(diff)}); "
                              "use another output folder, or pass --restart to start over")
    device = setup_device(cfg)
    data = data or prepare_data(cfg.data, cfg.labeled_seed, device, cfg.train.fast.compile)
    log(f"data: {data.describe()}")
    out.mkdir(parents=True, exist_ok=True)   # after the data: a run refused for its data leaves no folder
    if not existed:
        _hold_folder(held, out)
    runner = build_runner(cfg, data.num_classes, device)
    student, teacher, optimizer, bf16, fast = runner.student, runner.teacher, runner.optimizer, runner.bf16, runner.fast
    base_lr = optimizer.param_groups[0]["lr"]
    steps_per_epoch = cfg.train.steps_per_epoch or data.default_steps_per_epoch(cfg.train.batch_size)

    history: list[dict[str, float]] = []
    start_epoch = 0
    if resume is not None:
        student.load_state_dict(resume["student"])
        teacher.load_state_dict(resume["teacher"])
        optimizer.load_state_dict(upgrade_optimizer_state(resume["optimizer"], resume["student"], student))
        history, start_epoch = resume["history"], resume["epoch"]
        log(f"resumed from {ckpt_path} at epoch {start_epoch}")
        _write_metrics(out, history)   # the checkpoint's: the disk may have filled before its epoch's line was written
    checkpoints.write_text(out / "config.json", json.dumps(cfg.to_dict(), indent=2))
    log(f"model {cfg.model} ({sum(p.numel() for p in student.parameters()):,} parameters), method {cfg.method}, "
        f"device {device}{' bf16' if bf16 else ''}{' compiled' if runner.compiled else ''}"
        f"{'' if fast else ', the plain step (train.fast.enabled false)'}{TUNED_NOTE if fast and fast.tuned else ''}"
        f"{' + CUDA graphs' if fast and fast.graphs else ''}"
        f"{' + one CUDA graph per step' if fast and fast.step_graph else ''}, "
        f"{cfg.train.epochs} epochs x {steps_per_epoch} steps")

    split = cfg.data.eval_split
    fmt = runner.memory_format
    turn = gpu_identity(device) if shared_gpu and cfg.train.fast.gpu_turns and device.type == "cuda" else None
    epoch_times: list[float] = []
    for epoch in range(start_epoch, cfg.train.epochs):
        t0 = time.monotonic()
        with out_of_memory_stops(cfg, device, epoch + 1, "training"):
            metrics = train_epoch(cfg, runner, data, epoch, steps_per_epoch, base_lr, log=log, turn=turn)
        check_finite(metrics, epoch + 1, cfg)   # before the checkpoint: the last one stays the last good one
        train_time = time.monotonic() - t0
        for name, model in (("teacher", teacher), ("student", student)):
            with out_of_memory_stops(cfg, device, epoch + 1, "evaluation"):
                scores = evaluate(model, data.eval_batches(split, cfg.train.eval_batch_size), runner.autocast, fmt)
            metrics.update(M.eval_metrics(split, name, scores))
        t_saved = time.monotonic()
        metrics[M.STEPS_PER_S] = steps_per_epoch / train_time
        metrics[M.IMAGES_PER_S] = steps_per_epoch * cfg.train.batch_size * (2 if cfg.method != "supervised" else 1) / train_time
        metrics[M.TRAIN_S], metrics[M.EVAL_S] = train_time, t_saved - t0 - train_time
        history.append(metrics)
        checkpoints.save({
            "config": cfg.to_dict(), "epoch": epoch + 1, "step": (epoch + 1) * steps_per_epoch,
            "student": student.state_dict(), "teacher": teacher.state_dict(),
            "optimizer": optimizer.state_dict(), "history": history, "split_hashes": data.split_hashes,
            "data": data_record(data),   # class names, normalisation, input shape: for `cowtune evaluate`
            "rng": {"torch": torch.get_rng_state(), "mask_generator": runner.generator.get_state(),
                    "cuda": torch.cuda.get_rng_state_all() if device.type == "cuda" else None},
        }, ckpt_path, keep_previous)
        metrics[M.CHECKPOINT_S] = time.monotonic() - t_saved   # known once it is written: reported, not in its own checkpoint
        _write_metrics(out, history)
        epoch_times.append(time.monotonic() - t0)
        recent = epoch_times[1:] or epoch_times  # the first epoch here pays for compilation
        per_epoch = sum(recent) / len(recent)
        log(_summary(epoch + 1, cfg.train.epochs, metrics, split, per_epoch * (cfg.train.epochs - epoch - 1)))
        if report is not None:
            report(epoch + 1, metrics, ckpt_path)

    final = dict(history[-1]) if history else {}
    result = {"method": cfg.method, "model": cfg.model, "dataset": cfg.data.dataset, "seed": cfg.seed,
              "n_labeled": data.sizes.get("labeled"), "split_hashes": data.split_hashes, "final": final,
              "best": best_epoch(history, M.eval_key(split, "error", "teacher"))}
    checkpoints.write_text(out / "result.json", json.dumps(result, indent=2))
    return result


def _write_metrics(out: Path, history: list[dict[str, float]]) -> None:
    checkpoints.write_text(out / "metrics.jsonl", "".join(json.dumps(h) + "\n" for h in history))
