"""Typed, validated training configuration: the only place defaults live.

A config is a tree of frozen dataclasses. ``TrainConfig.from_dict`` builds one from plain data
(YAML, JSON, a Tune sample) and rejects unknown keys and bad values with a message naming the
field; ``to_dict`` goes back. Defaults follow the authors' published command-line defaults
(CowMix on CIFAR-10 with 1,000 labels) except where a field's comment says otherwise. What only makes a run faster
is one section, ``train.fast`` (``FastSettings``); ``train.fast: false`` is the plain step. ``from_dict`` also reads
the layout before 2026-12-03, with those settings directly under ``train`` (``upgrade_layout``), so that old
checkpoints, run folders and searches' stores still load; ``to_dict`` writes today's.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from trainables.ssl.regularizers import Regularizer, regularizer_from_dict, regularizer_to_dict
from trainables.validation import ConfigError, build_dataclass, check, dataclass_to_dict


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    dataset: str = "cifar10"          # registry name: cifar10 | cifar100 | svhn | imagefolder | digits
    root: str = "data"                # torchvision folder, ImageFolder tree, or a .zip of one
    download: bool = False            # let torchvision download (needs a network)
    n_val: int = 5000                 # validation holdout carved from train first (0 = none)
    val_seed: int = 131               # StratifiedShuffleSplit seed of the holdout
    n_labeled: int = 1000             # labeled subset size; -1 = every non-validation image
    labeled_seed: int | None = None   # None: the run seed picks the labeled subset
    eval_split: str = "val"           # "val" (holdout) or "test" (the dataset's test split)
    flip: bool | None = None          # horizontal flips; None: dataset default (no flip for svhn, digits)
    pad: int = 4                      # reflect padding before the random crop (small images)
    image_size: int | None = None     # ImageFolder: side of the training crop; None: native / 224
    colour_jitter: bool = False       # large-image path only (inception crop + flip + jitter)
    pipeline: str = "auto"            # "device" (decoded uint8 on the training device), "loader", "auto"
    workers: int = 4                  # large-image path: DataLoader workers (decode pil), or the threads that read
                                      # the files' bytes (decode device)
    decode: str = "auto"              # large-image files: "pil" (PIL in DataLoader workers, on the host), "device"
                                      # (torchvision's decode_jpeg on the training device, nvJPEG on a GPU, and
                                      # the augmentation there as batched tensor ops), "hybrid" (each batch split
                                      # between the two, data.cpu_fraction), "auto" (hybrid by a rule on cuda when
                                      # the files are JPEGs, else pil); docs/imagenet.md section 5
    cpu_fraction: float | None = None  # decode hybrid: the share of each batch's images PIL decodes in the workers
                                      # (the rest on the device), by position, the same every step; None: the
                                      # rule that decode auto uses (trainables.data.hybrid_loader.auto_cpu_fraction)
    unreadable: str = "stop"          # an image file that cannot be decoded: "stop" (named, nothing trains) or
                                      # "skip" (left out, each named; small images decoded once only)

    def __post_init__(self) -> None:
        check(self.n_val >= 0, "data.n_val", "be >= 0", self.n_val)
        check(self.n_labeled == -1 or self.n_labeled >= 1, "data.n_labeled", "be >= 1 or -1 (all)", self.n_labeled)
        check(self.eval_split in ("val", "test"), "data.eval_split", "be 'val' or 'test'", self.eval_split)
        check(self.eval_split != "val" or self.n_val > 0, "data.eval_split",
              "be 'test' when data.n_val is 0 (there is no holdout to evaluate on)", self.eval_split)
        check(self.pad >= 0, "data.pad", "be >= 0", self.pad)
        check(self.image_size is None or self.image_size >= 8, "data.image_size", "be >= 8 or null", self.image_size)
        check(self.pipeline in ("auto", "device", "loader"), "data.pipeline", "be 'auto', 'device' or 'loader'", self.pipeline)
        check(self.workers >= 0, "data.workers", "be >= 0", self.workers)
        check(self.decode in ("auto", "pil", "device", "hybrid"), "data.decode", "be 'auto', 'pil', 'device' or "
              "'hybrid'", self.decode)
        check(self.cpu_fraction is None or 0 <= self.cpu_fraction <= 1, "data.cpu_fraction", "be in [0, 1] or null",
              self.cpu_fraction)
        check(self.cpu_fraction is None or self.decode == "hybrid", "data.cpu_fraction",
              f"be null unless data.decode is 'hybrid' (data.decode is '{self.decode}')", self.cpu_fraction)
        check(self.unreadable in ("stop", "skip"), "data.unreadable", "be 'stop' or 'skip'", self.unreadable)


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr_per_256: float = 0.05          # SGD learning rate per 256 labeled images; effective = lr_per_256 * batch / 256
    momentum: float = 0.9
    nesterov: bool = True
    l2: float = 5e-4                  # coupled L2 on conv and linear weights only (not biases, not BN)
    schedule: str = "stepped"         # "stepped" | "cosine" | "constant"
    steps: tuple[tuple[float, float], ...] = ((120.0, 0.2), (240.0, 0.04))  # (epoch, absolute factor of base)
    cosine_half_epochs: float = 300.0  # cosine: epochs for the half cosine from 1 to 0
    warmup_epochs: float = 0.0        # linear warm-up from 0, any schedule

    def __post_init__(self) -> None:
        check(self.lr_per_256 > 0, "optim.lr_per_256", "be > 0", self.lr_per_256)
        check(0 <= self.momentum < 1, "optim.momentum", "be in [0, 1)", self.momentum)
        check(self.l2 >= 0, "optim.l2", "be >= 0", self.l2)
        check(self.schedule in ("stepped", "cosine", "constant"), "optim.schedule",
              "be 'stepped', 'cosine' or 'constant'", self.schedule)
        check(all(len(s) == 2 and s[0] >= 0 and s[1] >= 0 for s in self.steps), "optim.steps",
              "be a list of [epoch >= 0, factor >= 0] pairs", self.steps)
        check(list(self.steps) == sorted(self.steps), "optim.steps", "be sorted by epoch", self.steps)
        check(self.cosine_half_epochs > 0, "optim.cosine_half_epochs", "be > 0", self.cosine_half_epochs)
        check(self.warmup_epochs >= 0, "optim.warmup_epochs", "be >= 0", self.warmup_epochs)


@dataclass(frozen=True, kw_only=True)
class TeacherConfig:
    alpha: float = 0.97               # EMA decay: teacher = alpha * teacher + (1 - alpha) * student
    anneal: bool = False              # scale (1 - alpha) by the learning-rate schedule factor

    def __post_init__(self) -> None:
        check(0 <= self.alpha <= 1, "teacher.alpha", "be in [0, 1]", self.alpha)


@dataclass(frozen=True, kw_only=True)
class PerturbPath:
    """Erasure consistency: the student sees a perturbed view, the teacher the clean one."""
    regularizer: Regularizer
    weight: float = 1.0               # omega of the erasure loss
    conf_thresh: float = 0.97         # teacher confidence must exceed this (strict); <= 0 lets all pass
    conf_avg: bool = False            # False: per-sample mask; True: scale by the fraction passing

    def __post_init__(self) -> None:
        check(self.regularizer.kind == "perturb", "perturb.name", "name an erasure regularizer",
              self.regularizer.name)
        check(self.weight >= 0, "perturb.weight", "be >= 0", self.weight)
        check(self.conf_thresh < 1, "perturb.conf_thresh", "be < 1", self.conf_thresh)


@dataclass(frozen=True, kw_only=True)
class MixPath:
    """Mixing consistency: the student sees a mix of two images, the target mixes the teacher's."""
    regularizer: Regularizer
    weight: float = 30.0              # omega of the mix loss
    conf_thresh: float = 0.6
    conf_avg: bool = True             # True: scale the loss by the fraction of the batch passing
    conf_mode: str = "mix_conf"       # "mix_conf": blend the two confidences; "mix_prob": of the blended target
    mix_logits: bool = False          # blend teacher logits (then softmax) instead of probabilities

    def __post_init__(self) -> None:
        check(self.regularizer.kind == "mix", "mix.name", "name a mixing regularizer", self.regularizer.name)
        check(self.weight >= 0, "mix.weight", "be >= 0", self.weight)
        check(self.conf_thresh < 1, "mix.conf_thresh", "be < 1", self.conf_thresh)
        check(self.conf_mode in ("mix_conf", "mix_prob"), "mix.conf_mode", "be 'mix_conf' or 'mix_prob'",
              self.conf_mode)


# What train.fast.enabled false sets: the plain step's settings, where each of these may be left at its default
PLAIN_FAST = MappingProxyType({"compile": False, "cuda_graph": "none", "stack_student_calls": False,
                               "conv_kernels": "cudnn", "precision": "fp32", "wgrad_stream": False,
                               "channels_last": False})


@dataclass(frozen=True, kw_only=True)
class FastSettings:
    """``train.fast``: how fast the step runs, not what it computes (``trainables.fast``; docs/performance.md).

    With ``enabled`` false the step is the plain one, the specification (eager, float32, one student call per
    batch, cuDNN, no CUDA graph or stream) and ``trainables.fast`` is not entered: each setting of ``PLAIN_FAST``
    holds its plain value (``from_plain`` gives it where it was left at its default; another is refused). Every
    setting here but ``enabled``, ``precision`` and ``channels_last`` may change between a run and its resume
    (``trainables.trainer.RESUME_FREE``): they pick other kernels, whose results agree to rounding. ``precision``
    bf16 trains to other weights, not to rounding. In YAML ``train: {fast: false}`` is ``{fast: {enabled: false}}``.
    """
    enabled: bool = True              # false: the plain step (above)
    precision: str = "auto"           # "fp32" | "bf16" (autocast) | "auto" (bf16 on cuda, fp32 on cpu)
    channels_last: bool = True        # NHWC memory format on cuda
    compile: bool | None = None       # torch.compile the forward passes (and the on-device augmentation); None:
                                      # on for cuda, off for cpu
    compile_mode: str = "reduce-overhead"  # torch.compile mode (its CUDA graphs only with cuda_graph: model)
    cuda_graph: str = "step"          # cuda: "step" = one graph per training step, "model" = compile's own
                                      # graphs around each model pass, "none"
    stack_student_calls: bool = True  # one student call over the labeled, perturbed and mixed batches,
                                      # each with its own batch-norm statistics (same result, faster)
    gpu_turns: bool = True            # packed with other trials on one GPU: each epoch's steps run in turns,
                                      # one trial at a time, instead of time-slicing the GPU
    conv_kernels: str = "triton"      # cuda: "triton" = our kernels for the 3x3 stride-1 convolutions where
                                      # they beat cuDNN (on sm90: H100, H200), cuDNN for the rest; "cudnn" =
                                      # cuDNN for all (trainables.fast.fast_conv)
    wgrad_stream: bool = True         # cuda, compiled, one stacked student call, cuda_graph "step": the
                                      # convolutions' weight gradients on a side stream, beside the rest of
                                      # the backward pass (trainables.fast.wgrad_stream)
    combo_kernels: bool | None = None  # cuda, compiled: Inductor's combo kernels (independent small kernels
                                      # launched as one); None: for the models where they were measured to
                                      # pay (trainables.fast.compile_options.COMBO_KERNEL_MODELS)
    dependent_launch: bool | None = None  # cuda, compiled: the models' Inductor kernels launched with programmatic
                                      # dependent launch (Hopper or newer: a kernel's blocks start while the
                                      # one before it finishes; Inductor's triton.enable_pdl); None: for the
                                      # models where it was measured to pay
                                      # (trainables.fast.compile_options.DEPENDENT_LAUNCH_MODELS: not the shake-shake
                                      # models, where it measured slower)
    realize_reads_threshold: int | None = None  # compiled: Inductor's realize_reads_threshold for the student and
                                      # teacher (a result several kernels read is recomputed in each while it
                                      # reads at most this many buffers, else stored); None: the model's entry
                                      # in trainables.fast.compile_options.REALIZE_READS_BY_MODEL, else the trainer's 8
    tune_kernels: bool | None = None  # cuda, compiled: Inductor's coordinate-descent tuning of the models'
                                      # kernels (block sizes measured once per machine, then cached); None: on
                                      # unless train.deterministic, and off in a search's trials
                                      # (trainables.fast.compile_options.tune_kernels_wanted)
    compile_masks_and_losses: bool = True  # compiled: the masks and mixing after their random draws with
                                      # the stacking of the student's batches, and the losses, compiled too
                                      # (trainables.step.student_inputs, loss_terms)

    def __post_init__(self) -> None:
        check(self.precision in ("auto", "fp32", "bf16"), "train.fast.precision", "be 'auto', 'fp32' or 'bf16'",
              self.precision)
        check(self.compile_mode in COMPILE_MODES, "train.fast.compile_mode", f"be one of {COMPILE_MODES}",
              self.compile_mode)
        check(self.cuda_graph in ("step", "model", "none"), "train.fast.cuda_graph", "be 'step', 'model' or 'none'",
              self.cuda_graph)
        check(self.conv_kernels in ("cudnn", "triton"), "train.fast.conv_kernels", "be 'cudnn' or 'triton'",
              self.conv_kernels)
        check(self.realize_reads_threshold is None or self.realize_reads_threshold >= 1,
              "train.fast.realize_reads_threshold", "be >= 1 or null", self.realize_reads_threshold)
        for name, plain in PLAIN_FAST.items():   # (from_plain gives them; a constructor call must too)
            check(self.enabled or getattr(self, name) == plain, f"train.fast.{name}",
                  f"be {json.dumps(plain)} when train.fast.enabled is false (the plain step)", getattr(self, name))

    def bf16(self, device_type: str) -> bool:
        """Whether the step (and an evaluation of its models, as trained) runs in bfloat16 on ``device_type``."""
        return self.precision == "bf16" or (self.precision == "auto" and device_type == "cuda")

    @classmethod
    def from_plain(cls, value: Any) -> "FastSettings":
        """``train.fast`` from plain data: a mapping of these fields, or true / false for ``{enabled: ...}``. With
        ``enabled`` false each setting of ``PLAIN_FAST`` left out or at its default takes its plain value (a config
        written out in full names every default); another value is refused, naming the key."""
        d = {"enabled": value} if isinstance(value, bool) else value
        if not isinstance(d, dict):
            raise ConfigError(f"train.fast must be true, false or a mapping of its settings, got {value!r}")
        if d.get("enabled", True) is False:
            defaults = {f.name: f.default for f in dataclasses.fields(cls)}
            for name, plain in PLAIN_FAST.items():
                given = d.get(name, defaults[name])
                check(given in (defaults[name], plain), f"train.fast.{name}",
                      f"be {json.dumps(plain)} or left out: train.fast.enabled is false (the plain step)", given)
            d = {**d, **PLAIN_FAST}
        return build_dataclass(cls, d, prefix="train.fast.")


@dataclass(frozen=True, kw_only=True)
class TrainSettings:
    batch_size: int = 256             # labeled batch; the unlabeled batch has the same size
    epochs: int = 300
    steps_per_epoch: int | None = None  # None: n_unlabeled // batch_size (195 on CIFAR-10 without holdout)
    eval_batch_size: int = 1000
    device: str = "auto"              # "auto" (cuda when present), "cpu", "cuda", "cuda:N"
    fast: FastSettings = field(default_factory=FastSettings)   # the speed settings; false: the plain step
    bn_batch: int | None = None       # ghost batch norm: the student's batch norms normalise each of its batches in
                                      # groups of this many images, each group with its own statistics, as the
                                      # reference's per-device statistics under pmap (8 devices: 32); None: the
                                      # whole batch. The teacher and evaluation use running statistics either way
    deterministic: bool = False       # deterministic cuDNN kernels (bit-exact resume on GPU)
    threads: int | None = None        # CPU intra-op threads; None: torch default

    def __post_init__(self) -> None:
        check(self.batch_size >= 2, "train.batch_size", "be >= 2", self.batch_size)
        check(self.epochs >= 1, "train.epochs", "be >= 1", self.epochs)
        check(self.steps_per_epoch is None or self.steps_per_epoch >= 1, "train.steps_per_epoch",
              "be >= 1 or null", self.steps_per_epoch)
        check(self.bn_batch is None or (self.bn_batch >= 2 and self.batch_size % self.bn_batch == 0),
              "train.bn_batch", f"be null or an integer >= 2 that divides train.batch_size ({self.batch_size})",
              self.bn_batch)
        check(self.eval_batch_size >= 1, "train.eval_batch_size", "be >= 1", self.eval_batch_size)
        check(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
              "train.device", "be 'auto', 'cpu', 'cuda' or 'cuda:N'", self.device)
        check(self.threads is None or self.threads >= 1, "train.threads", "be >= 1 or null", self.threads)


# The layout before 2026-12-03: the speed settings sat directly under train, beside train.fast true or false.
# Checkpoints, run folders, searches' stores and promoted YAMLs of that time hold it; upgrade_layout reads it.
FLAT_FAST_KEYS = ("precision", "channels_last", "compile", "compile_mode", "cuda_graph", "stack_student_calls",
                  "gpu_turns", "conv_kernels", "wgrad_stream", "combo_kernels", "dependent_launch",
                  "realize_reads_threshold", "tune_kernels", "compile_masks_and_losses")


def todays_key(key: str, switch: bool = False) -> str:
    """A dotted config key of the layout before 2026-12-03 in today's spelling: ``train.compile`` (any of
    ``FLAT_FAST_KEYS``) is ``train.fast.compile``, and ``train.fast`` given as a bool (``switch``) is
    ``train.fast.enabled``; every other key as it is. For keys one at a time (``--set`` items, a search's recorded
    parameters); ``upgrade_layout`` does the same to a whole mapping."""
    if key == "train.fast" and switch:
        return "train.fast.enabled"
    name = key.removeprefix("train.")
    return f"train.fast.{name}" if key.startswith("train.") and name in FLAT_FAST_KEYS else key


def upgrade_layout(d: dict[str, Any]) -> dict[str, Any]:
    """A config's plain data in today's layout: the speed settings of the layout before 2026-12-03
    (``train.compile``, ``FLAT_FAST_KEYS``) moved into ``train.fast`` (``train.fast: false`` with them becomes
    ``train.fast.enabled: false``). Returned as it is when it has none; a key given in both layouts is refused."""
    train = d.get("train")
    moved = [k for k in FLAT_FAST_KEYS if isinstance(train, dict) and k in train]
    if not moved:
        return d
    fast = train.get("fast", {})
    fast = {"enabled": fast} if isinstance(fast, bool) else fast
    if not isinstance(fast, dict):
        return d   # from_plain names what is wrong with it
    both = [k for k in moved if k in fast]
    if both:
        raise ConfigError(f"train.{both[0]} and train.fast.{both[0]} are both given: train.{both[0]} is the layout "
                          f"before 2026-12-03, give train.fast.{both[0]} alone")
    rest = {k: v for k, v in train.items() if k not in moved}
    return {**d, "train": {**rest, "fast": {**fast, **{k: train[k] for k in moved}}}}


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    seed: int = 0                     # run seed: weights, sampling order, augmentation, masks
    model: str = "wrn26_6_shakeshake"  # see `cowtune list`; WRN-26 shake-shake 96x2d as in the paper
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    perturb: PerturbPath | None = None  # erasure path (mean_teacher, randerase, cowout); None = off
    mix: MixPath | None = None          # mixing path (ict, cutmix, cowmix); None = off
    train: TrainSettings = field(default_factory=TrainSettings)

    @property
    def method(self) -> str:
        """Short name of the method: the regularizers in use, or 'supervised'."""
        names = [p.regularizer.name for p in (self.perturb, self.mix) if p is not None]
        return "+".join(names) or "supervised"

    @property
    def labeled_seed(self) -> int:
        return self.seed if self.data.labeled_seed is None else self.data.labeled_seed

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        """Build and validate a config; raises ConfigError naming the bad field."""
        if not isinstance(d, dict):
            raise ConfigError(f"a config must be a mapping, got {type(d).__name__}")
        d = upgrade_layout(d)   # a config of the layout before 2026-12-03, as a checkpoint or a search's store has it
        d = dict(d)
        if isinstance(d.get("train"), dict) and "fast" in d["train"]:
            d["train"] = {**d["train"], "fast": FastSettings.from_plain(d["train"]["fast"])}
        paths = {}
        for key, path_cls in (("perturb", PerturbPath), ("mix", MixPath)):
            if d.get(key) is not None:
                paths[key] = _path_from_dict(key, path_cls, d.pop(key))
            else:
                d.pop(key, None)
        cfg = build_dataclass(cls, d, prefix="", skip=("perturb", "mix"))
        return dataclasses.replace(cfg, **paths)

    def to_dict(self) -> dict[str, Any]:
        out = dataclass_to_dict(self, skip=("perturb", "mix"))
        for key in ("perturb", "mix"):
            path = getattr(self, key)
            out[key] = None if path is None else {
                **regularizer_to_dict(path.regularizer),
                **dataclass_to_dict(path, skip=("regularizer",)),
            }
        return out


def _path_from_dict(key: str, path_cls: type, d: Any) -> Any:
    if not isinstance(d, dict) or "name" not in d:
        raise ConfigError(f"{key} must be a mapping with a 'name' (a regularizer), got {d!r}")
    path_fields = {f.name for f in dataclasses.fields(path_cls)} - {"regularizer"}
    path_part = {k: v for k, v in d.items() if k in path_fields}
    reg_part = {k: v for k, v in d.items() if k not in path_fields}
    reg = regularizer_from_dict(reg_part, prefix=key, extra_allowed=sorted(path_fields))
    path = build_dataclass(path_cls, path_part, prefix=f"{key}.", skip=("regularizer",), extra={"regularizer": reg})
    return path


def check_batch_split(cfg: TrainConfig, world: int) -> None:
    """One line before any compute if ``world`` data-parallel workers cannot split ``cfg``'s batch: each takes
    ``train.batch_size / world`` images of every step (``trainables.data_parallel``), and ghost batch norm's groups
    must fit in that slice."""
    b = cfg.train.batch_size
    check(b % world == 0, "train.batch_size", f"be divisible by the {world} data-parallel workers that split it", b)
    check(cfg.train.bn_batch is None or (b // world) % cfg.train.bn_batch == 0, "train.bn_batch",
          f"divide each of the {world} workers' {b // world} images of train.batch_size {b}", cfg.train.bn_batch)
