"""One semi-supervised training step, as the paper's Algorithms 2 (CowOut) and 3 (CowMix) compute it: the
supervised loss on the labeled batch, then the erasure path's and the mixing path's consistency losses against the
Mean Teacher's confidence-gated predictions, one SGD update, the teacher's EMA.

"Milking CowMask for Semi-Supervised Image Classification", arXiv:2003.12022; semantics of the authors'
``train_step`` (``../shared/reference/cowmask-reference.md`` section 3). ``train_step`` is the whole step, top to
bottom; the parts it calls are named in ``Kernels`` (the plain ones are this module's functions), its numbers in
``PathNumbers``, and what it trains is a ``StepRunner``'s. The fast path (``trainables.fast.switch.FastStep``,
which the trainer hands to the runner unless ``train.fast`` is false) wraps this same function: it swaps compiled
kernels and CUDA streams into it, passes its numbers as device tensors, and may capture the whole of it in one CUDA
graph; it changes no result. This module imports nothing of ``trainables.fast``.

The reference calls the student once per batch, so batch-norm statistics are per batch; with
``train.fast.stack_student_calls`` the batches are stacked into one call whose batch norm keeps per-batch statistics
(``trainables.models.segmented_bn``), the same result with fewer, larger kernels. The teacher runs in eval mode
under ``no_grad``. Metrics stay on the device as running sums; nothing here synchronises with the host.
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainables import metrics as M
from trainables.config import MixPath, PerturbPath, TrainConfig
from trainables.data import Batch
from trainables.models.segmented_bn import batch_segments, segmentable, set_ghost_batch
from trainables.ssl.ema import EmaPairs, ema_update_, teacher_logits
from trainables.ssl.losses import confidence_weight, mix_targets, squared_error, wide
from trainables.ssl.regularizers import Regularizer


@contextlib.contextmanager
def frozen_bn_stats(model: nn.Module):
    """Run batch norm in train mode without updating its running statistics (momentum 0)."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [m.momentum for m in bns]
    for m in bns:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, mom in zip(bns, saved):
            m.momentum = mom


def student_inputs(x_sup: torch.Tensor | None, x_unsup1: torch.Tensor, x0: torch.Tensor,
                   perturb: Regularizer | None, perturb_draws: dict[str, torch.Tensor] | None,
                   mix: Regularizer | None, mix_draws: dict[str, torch.Tensor] | None,
                   stacked: bool, channels_last: bool) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The student's batches in the reference's call order (labeled, erased, mixed with the unlabeled batch
    rolled by one), stacked into one or not, in the model's memory format; and the mix blend. Everything
    after the regularizers' random draws: compiled on a GPU (train.fast.compile_masks_and_losses), one compilation
    for every trial's numbers (the fast path puts them in the draws as tensors), where eagerly it is some 40 small
    kernels on the way to the student's first convolution."""
    xs = [x_sup] if x_sup is not None else []
    if perturb is not None:
        xs.append(perturb.perturb_drawn(x_unsup1, perturb_draws))
    blend = None
    if mix is not None:
        x_mixed, blend = mix.mix_drawn(x0, torch.roll(x0, shifts=-1, dims=0), mix_draws)
        xs.append(x_mixed)
    if stacked:
        xs = [torch.cat(xs)]
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return [x.contiguous(memory_format=fmt) for x in xs], blend


class PathNumbers(NamedTuple):
    """The paths' numbers that the losses read, by name: omega (the consistency loss's weight) and psi (the teacher's
    confidence threshold) of the erasure path and of the mixing path; 0 for a path that is off. Floats in the plain
    step; the fast path passes 0-d device tensors instead, so that one compilation and one captured CUDA graph serve
    every trial's numbers (``trainables.fast.switch.FastStep``)."""
    erase_weight: float | Tensor
    erase_thresh: float | Tensor
    mix_weight: float | Tensor
    mix_thresh: float | Tensor

    @classmethod
    def of(cls, cfg: TrainConfig) -> "PathNumbers":
        erase, mix = cfg.perturb, cfg.mix
        return cls(erase.weight if erase else 0.0, erase.conf_thresh if erase else 0.0,
                   mix.weight if mix else 0.0, mix.conf_thresh if mix else 0.0)


def loss_terms(logits: list[torch.Tensor], teacher_logits: torch.Tensor | None, y_sup: torch.Tensor | None,
               blend: torch.Tensor | None, perturb: PerturbPath | None, mix: MixPath | None,
               numbers: PathNumbers) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The step's loss and its detached parts from the student's logits (``student_inputs``' order: labeled,
    erased, mixed) and the teacher's logits z (float32 or wider): cross-entropy on the labeled batch (``y_sup``;
    None leaves it out), then each path's consistency loss d weighted by its omega. Of the paths it reads only the
    choices that shape the computation; their numbers come as ``numbers``."""
    stats = {}
    logits = list(logits)
    loss = torch.zeros((), device=logits[0].device)
    if y_sup is not None:
        logits_sup = logits.pop(0)
        loss_sup = F.cross_entropy(wide(logits_sup), y_sup)
        stats[M.LOSS_SUP] = loss_sup.detach()
        stats[M.ERR_SUP] = (logits_sup.argmax(1) != y_sup).float().mean()
        loss = loss_sup
    if perturb is not None:   # Algorithm 2: q = max_i z[i] > psi per sample; d = q ||y_m - z||^2
        teacher_probs = F.softmax(teacher_logits, dim=1)
        q, rate = confidence_weight(teacher_probs.max(1).values, numbers.erase_thresh, perturb.conf_avg)
        loss_cons = squared_error(logits.pop(0), teacher_probs, q)
        loss = loss + numbers.erase_weight * loss_cons
        stats[M.LOSS_CONS], stats[M.CONF_RATE] = loss_cons.detach(), rate
    if mix is not None:   # Algorithm 3: z_m and c_m blended by the mask's mean; q = mean(c_m > psi); d = q ||y_m - z_m||^2
        teacher_probs_mixed, confidence_mixed = mix_targets(teacher_logits, blend, mix.mix_logits, mix.conf_mode)
        q, rate = confidence_weight(confidence_mixed, numbers.mix_thresh, mix.conf_avg)
        loss_mix = squared_error(logits.pop(0), teacher_probs_mixed, q)
        loss = loss + numbers.mix_weight * loss_mix
        stats[M.LOSS_MIX], stats[M.MIX_CONF_RATE] = loss_mix.detach(), rate
    return loss, stats


def student_logits(student: Callable[[Tensor], Tensor], r: StepRunner, inputs: list[Tensor],
                   segments: list[tuple[int, bool]], stacked: bool) -> list[Tensor]:
    """The student's logits for each (batch size, updates BN running stats) in the reference's call order, from
    ``student_inputs``: one ``stacked`` batch, called once with per-batch batch-norm statistics, or one batch a
    call."""
    if stacked:
        with batch_segments(r.stacked_bns, tuple(segments)), r.autocast:
            logits = student(inputs[0])
        return list(logits.split([n for n, _ in segments]))
    out = []
    for x, (_, update) in zip(inputs, segments):
        with (contextlib.nullcontext() if update else frozen_bn_stats(r.student)), r.autocast:
            out.append(student(x))
    return out


def draw(reg: Regularizer, x: Tensor, gen: torch.Generator) -> dict[str, Any]:
    """The regularizer's random draws for a batch like ``x`` and its own numbers (``Regularizer.draw``)."""
    return reg.draw(x, gen)


def update_(optimizer: torch.optim.Optimizer, pairs: EmaPairs, alpha: float | Tensor) -> None:
    """SGD on the student, then the teacher follows it: teacher <- alpha * teacher + (1 - alpha) * student."""
    optimizer.step()
    ema_update_(pairs, alpha)


@dataclass(frozen=True)
class Kernels:
    """How ``train_step`` runs its parts: these defaults and the runner's models are the plain step, the
    specification. The fast path builds others that compute the same (``trainables.fast.switch.FastStep``): the
    models and the glue compiled, the teacher on its own CUDA stream (then ``loss_terms`` waits for it), the weight
    gradients on another (``backward`` joins it), the update in two parts around that join, and the regularizers'
    numbers put on the device as ``draw`` gives them."""
    student: Callable[[Tensor], Tensor]      # the student's forward pass
    teacher: Callable[[Tensor], Tensor]      # the teacher's logits, ``trainables.ssl.ema.teacher_logits``
    draw: Callable[[Regularizer, Tensor, torch.Generator], dict[str, Any]] = draw
    student_inputs: Callable[..., tuple[list[Tensor], Tensor | None]] = student_inputs
    loss_terms: Callable[..., tuple[Tensor, dict[str, Tensor]]] = loss_terms
    backward: Callable[[Tensor], None] = Tensor.backward
    update: Callable[[torch.optim.Optimizer, EmaPairs, float | Tensor], None] = update_


def train_step(r: StepRunner, k: Kernels, batch: Batch, gen: torch.Generator, lr: float | Tensor,
               alpha: float | Tensor, numbers: PathNumbers) -> None:
    """One step of the student's optimiser and the teacher's EMA on ``batch``: the supervised loss beside
    Algorithm 2 (erasure, ``cfg.perturb``) and Algorithm 3 (mixing, ``cfg.mix``), each path on when the config has
    it; ``batch.x_sup`` None leaves the supervised part out. ``lr``, ``alpha`` and ``numbers`` are floats, or 0-d
    device tensors in a captured CUDA graph. Masks are drawn from ``gen``; the step's metrics are added to
    ``r.sums``. In the paper's names: x_hat = std_aug(x) is ``batch.x_unsup0``, z the teacher's prediction on it,
    m a mask, x_hat_m the student's masked input and y_m its prediction, q the confidence gate, d the consistency
    loss."""
    cfg = r.cfg
    erase = cfg.perturb.regularizer if cfg.perturb is not None else None
    mix = cfg.mix.regularizer if cfg.mix is not None else None
    x_sup, x_hat = batch.x_sup, batch.x_unsup0
    x_hat_student = batch.x_unsup1   # what the erasure masks: x_hat, or for Mean Teacher a second augmentation
    # z = stop_gradient(g_phi(x_hat)): the teacher's logits on the unmasked batch; launched first, it may run
    # beside what follows (the fast path's teacher stream)
    z_logits = k.teacher(x_hat) if erase is not None or mix is not None else None
    # The masks m (and the erasure's noise): x_hat_m = x_hat * m + noise * (1 - m) for erasure; for mixing
    # x_hat_m = x_a * m + x_b * (1 - m), the partner x_b being the batch rolled by one (as in the reference)
    erase_draws = k.draw(erase, x_hat_student, gen) if erase is not None else None
    mix_draws = k.draw(mix, x_hat, gen) if mix is not None else None
    # Batch-norm statistics per batch, as the reference's separate student calls; with both paths on, the running
    # statistics are kept from the erasure call only
    segments = [(x_sup.shape[0], True)] if x_sup is not None else []
    segments += [(x_hat_student.shape[0], True)] if erase is not None else []
    segments += [(x_hat.shape[0], erase is None)] if mix is not None else []
    stacked = r.stacked_bns is not None and len(segments) > 1
    inputs, blend = k.student_inputs(x_sup, x_hat_student, x_hat, erase, erase_draws, mix, mix_draws, stacked,
                                     r.memory_format == torch.channels_last)
    # y = f_theta(x): the student on the labeled batch, then y_m on each masked one
    logits = student_logits(k.student, r, inputs, segments, stacked)
    # cross-entropy + omega_erase * d_erase + omega_mix * d_mix
    loss, stats = k.loss_terms(logits, z_logits, batch.y_sup if x_sup is not None else None, blend, cfg.perturb,
                               cfg.mix, numbers)
    # The update: SGD on the student at this step's learning rate, then the teacher follows it
    for group in r.optimizer.param_groups:
        group["lr"] = lr
    r.optimizer.zero_grad(set_to_none=True)
    k.backward(loss)
    if r.grad_sync is not None:
        r.grad_sync(r.student)   # a data-parallel worker's all-reduce of the gradients
    k.update(r.optimizer, r.pairs, alpha)   # teacher <- alpha * teacher + (1 - alpha) * student
    keys = list(stats)
    torch._foreach_add_([r.sums[key] for key in keys], [stats[key] for key in keys])   # one fused kernel


class StepRunner:
    """What one run trains and how: the student, teacher, optimiser and the device-side metric sums, and the step
    that trains them, ``train_step`` with the plain ``Kernels``. ``fast`` (the trainer passes
    ``trainables.fast.switch.FastStep`` unless ``train.fast`` is false) is called with ``train_step`` and the
    runner, and gives what then runs each step in its place: that same function with faster kernels, or captured
    in a CUDA graph."""

    def __init__(self, cfg: TrainConfig, student: nn.Module, teacher: nn.Module,
                 optimizer: torch.optim.Optimizer, device: torch.device, bf16: bool,
                 grad_sync: Callable[[nn.Module], None] | None = None,
                 fast: Callable[[Callable[..., None], StepRunner], Any] | None = None):
        """``grad_sync``: called with the student after the backward pass, before the update (a data-parallel
        worker's all-reduce of the gradients: ``trainables.data_parallel.GradientMean``); inside a captured step too."""
        self.cfg, self.student, self.teacher, self.optimizer = cfg, student, teacher, optimizer
        self.device, self.bf16, self.grad_sync = device, bf16, grad_sync
        set_ghost_batch(student, cfg.train.bn_batch)   # training-mode statistics only: the teacher is always in eval
        self.pairs = EmaPairs(teacher, student)
        self.memory_format = torch.channels_last if (cfg.train.fast.channels_last and device.type == "cuda") \
            else torch.contiguous_format
        self.cuda_graph = cfg.train.fast.cuda_graph if device.type == "cuda" else "none"
        # autocast's weight-cast cache must not outlive a CUDA graph capture: off when the step is captured
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16,
                                       cache_enabled=self.cuda_graph != "step")
        self.stacked_bns = segmentable(student) if cfg.train.fast.stack_student_calls else None
        # (a partial, not a bound method: the kernels hold no reference back to the runner)
        self.kernels = Kernels(student=student,
                               teacher=functools.partial(teacher_logits, teacher, self.autocast, self.memory_format))
        self.numbers = PathNumbers.of(cfg)
        self.generator = torch.Generator(device=device)   # one object for the run: a captured step holds it
        self.sums: dict[str, torch.Tensor] = {}
        self.reset_metrics()
        # {time/first_step_s, time/compile_wait_s} once the first step (compilation, cuDNN tuning, capture) ran
        self.first_step: dict[str, float] | None = None
        self.fast = fast(train_step, self) if fast is not None else None

    @property
    def compiled(self) -> bool:
        return self.fast is not None and self.fast.compiled

    def reset_metrics(self) -> None:
        keys = [M.LOSS_SUP, M.ERR_SUP]
        if self.cfg.perturb is not None:
            keys += [M.LOSS_CONS, M.CONF_RATE]
        if self.cfg.mix is not None:
            keys += [M.LOSS_MIX, M.MIX_CONF_RATE]
        if set(self.sums) == set(keys):
            for v in self.sums.values():   # in place: a captured step graph adds into these tensors
                v.zero_()
        else:
            self.sums = {k: torch.zeros((), device=self.device) for k in keys}
        self.count = 0

    def read_metrics(self) -> dict[str, float]:
        """Means since the last reset; the one host synchronisation of an epoch."""
        if self.count == 0:
            return {}
        values = torch.stack(list(self.sums.values())).cpu().tolist()
        return {k: v / self.count for k, v in zip(self.sums, values)}

    def step(self, batch: Batch, gen: torch.Generator, lr: float, alpha: float) -> None:
        """One optimiser step and one teacher update. The first compiles where the fast path compiles (on CUDA
        under the machine's first-compile lock, ``FastStep.first_step_lock``) and is timed."""
        if self.first_step is not None:
            return self._step(batch, gen, lr, alpha)
        t0 = time.monotonic()
        lock = self.fast.first_step_lock(self, batch) if self.fast is not None \
            else contextlib.nullcontext({"waited_s": 0.0})
        with lock as waited:
            self._step(batch, gen, lr, alpha)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)   # its cuDNN tuning too, before the next trial's
        self.first_step = {M.FIRST_STEP_S: time.monotonic() - t0 - waited["waited_s"],
                           M.COMPILE_WAIT_S: waited["waited_s"]}

    def _step(self, batch: Batch, gen: torch.Generator, lr: float, alpha: float) -> None:
        if self.fast is not None:
            self.fast(self, batch, gen, lr, alpha)
        else:
            train_step(self, self.kernels, batch, gen, lr, alpha, self.numbers)
        self.count += 1

    def release_graphs(self) -> None:
        """Frees the whole-step CUDA graph, if captured (the next step captures again): before a data-parallel
        worker's process group is destroyed (``StepGraph.release``)."""
        if self.fast is not None:
            self.fast.release()


TOP5_MIN_CLASSES = 11   # top-5 error is reported for more than 10 classes (ImageNet's table has it); below, it says little


class Scores(NamedTuple):
    """What ``evaluate`` measures: top-1 error, mean cross-entropy and, for more than 10 classes, top-5 error."""
    error: float
    loss: float
    error5: float | None = None


@torch.no_grad()
def evaluate(model: nn.Module, batches, autocast, memory_format) -> Scores:
    """Top-1 error, mean cross-entropy and top-5 error (more than 10 classes) of ``model`` over (x, y) batches; one
    host sync at the end."""
    was_training = model.training
    model.eval()
    wrong = torch.zeros((), dtype=torch.float64)
    wrong5 = torch.zeros((), dtype=torch.float64)
    loss_sum = torch.zeros((), dtype=torch.float64)
    n, classes = 0, 0
    for x, y in batches:
        with autocast:
            logits = model(x.contiguous(memory_format=memory_format)).float()
        if wrong.device != logits.device:
            wrong, wrong5, loss_sum = wrong.to(logits.device), wrong5.to(logits.device), loss_sum.to(logits.device)
        classes = logits.shape[1]
        wrong += (logits.argmax(1) != y).sum()
        if classes >= TOP5_MIN_CLASSES:
            wrong5 += (logits.topk(5, 1).indices != y[:, None]).all(1).sum()
        loss_sum += F.cross_entropy(logits, y, reduction="sum").double()
        n += y.shape[0]
    model.train(was_training)
    if n == 0:
        return Scores(float("nan"), float("nan"))
    top5 = (wrong5 / n).item() if classes >= TOP5_MIN_CLASSES else None
    return Scores((wrong / n).item(), (loss_sum / n).item(), top5)
