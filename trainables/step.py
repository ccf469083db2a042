"""One semi-supervised training step, as the paper's Algorithms 2 (CowOut) and 3 (CowMix) compute it: the
supervised loss on the labeled batch, then the erasure path's and the mixing path's consistency losses against the
Mean Teacher's confidence-gated predictions, one SGD update, the teacher's EMA.

"Milking CowMask for Semi-Supervised Image Classification", arXiv:2003.12022; semantics of the authors'
``train_step`` (``../shared/reference/cowmask-reference.md`` section 3). What a step computes lives here, written
plainly: ``student_inputs`` (the regularizers' perturbed and mixed batches), ``loss_terms`` and
``StepRunner.losses`` / ``_step``. How it runs fast (compiled, one CUDA graph, streams, our kernels) is
``trainables.fast``'s, added through ``trainables.fast.switch.speed_up`` and changing no result. The reference calls
the student once per batch, so batch-norm statistics are per batch; by default the batches are stacked into one
call whose batch norm keeps per-batch statistics (``trainables.models.segmented_bn``), which gives the same result
with fewer, larger kernels. The teacher runs in eval mode under ``no_grad``. Metrics stay on the device as running
sums; nothing here synchronises with the host.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainables import metrics as M
from trainables.config import MixPath, PerturbPath, TrainConfig
from trainables.data import Batch
from trainables.fast.switch import backward_on_side, first_step_lock, speed_up
from trainables.models.segmented_bn import batch_segments, segmentable, set_ghost_batch
from trainables.ssl.ema import EmaPairs, ema_update_, ema_weight
from trainables.ssl.losses import confidence_weight, mix_targets, squared_error, wide
from trainables.ssl.masks import device_constants
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
    after the regularizers' random draws: compiled on a GPU (train.compile_masks_and_losses), one compilation
    for every trial's numbers (they come as tensors in the draws), where eagerly it is some 40 small kernels on
    the way to the student's first convolution."""
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


def path_numbers(cfg: TrainConfig) -> tuple[float, ...]:
    """What ``loss_terms`` reads of the paths' numbers: omega and the confidence threshold of each path
    (0 for a path that is off)."""
    return tuple(v for path in (cfg.perturb, cfg.mix)
                 for v in ((path.weight, path.conf_thresh) if path is not None else (0.0, 0.0)))


def loss_terms(logits: list[torch.Tensor], teacher_logits: torch.Tensor | None, y_sup: torch.Tensor | None,
               blend: torch.Tensor | None, perturb: PerturbPath | None, mix: MixPath | None,
               numbers: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The step's loss and its detached parts from the student's logits (``student_inputs``' order: labeled,
    erased, mixed) and the teacher's logits (float32 or wider): cross-entropy on the labeled batch (``y_sup``; None leaves
    it out), then each path's weighted consistency loss. The paths' numbers come as ``numbers``
    (``path_numbers``): compiled with ``student_inputs``, one compilation serves every trial's; of the paths it
    reads only the choices that shape the computation."""
    stats = {}
    logits = list(logits)
    loss = torch.zeros((), device=numbers.device)
    if y_sup is not None:
        logits_sup = logits.pop(0)
        loss_sup = F.cross_entropy(wide(logits_sup), y_sup)
        stats[M.LOSS_SUP] = loss_sup.detach()
        stats[M.ERR_SUP] = (logits_sup.argmax(1) != y_sup).float().mean()
        loss = loss_sup
    if perturb is not None:
        teacher_probs = F.softmax(teacher_logits, dim=1)
        weight, rate = confidence_weight(teacher_probs.max(1).values, numbers[1], perturb.conf_avg)
        loss_cons = squared_error(logits.pop(0), teacher_probs, weight)
        loss = loss + numbers[0] * loss_cons
        stats[M.LOSS_CONS], stats[M.CONF_RATE] = loss_cons.detach(), rate
    if mix is not None:
        teacher_probs_mixed, confidence = mix_targets(teacher_logits, blend, mix.mix_logits, mix.conf_mode)
        weight, rate = confidence_weight(confidence, numbers[3], mix.conf_avg)
        loss_mix = squared_error(logits.pop(0), teacher_probs_mixed, weight)
        loss = loss + numbers[2] * loss_mix
        stats[M.LOSS_MIX], stats[M.MIX_CONF_RATE] = loss_mix.detach(), rate
    return loss, stats


class StepRunner:
    """Owns the student, teacher, optimiser and the device-side metric sums of one run.

    Built as the plain step, the specification: the student called eagerly once per batch (or once over the
    stacked batches, with per-batch batch norm), the teacher on the same stream, the update and the EMA as
    written. ``trainables.fast.switch.speed_up`` then gives it what ``train`` asks for (compiled models and glue,
    CUDA streams and graphs), unless ``train.fast`` is false."""

    def __init__(self, cfg: TrainConfig, student: nn.Module, teacher: nn.Module,
                 optimizer: torch.optim.Optimizer, device: torch.device, bf16: bool,
                 grad_sync: Callable[[nn.Module], None] | None = None):
        """``grad_sync``: called with the student after the backward pass, before the update (a data-parallel
        worker's all-reduce of the gradients: ``trainables.data_parallel.GradientMean``); inside a captured step too."""
        self.cfg, self.student, self.teacher, self.optimizer = cfg, student, teacher, optimizer
        self.device, self.bf16, self.grad_sync = device, bf16, grad_sync
        set_ghost_batch(student, cfg.train.bn_batch)   # training-mode statistics only: the teacher is always in eval
        self.pairs = EmaPairs(teacher, student)
        self.memory_format = torch.channels_last if (cfg.train.channels_last and device.type == "cuda") \
            else torch.contiguous_format
        self.cuda_graph = cfg.train.cuda_graph if device.type == "cuda" else "none"
        # autocast's weight-cast cache must not outlive a CUDA graph capture: off when the step is captured
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16,
                                       cache_enabled=self.cuda_graph != "step")
        self.stacked_bns = segmentable(student) if cfg.train.stack_student_calls else None
        # The plain step's parts; speed_up replaces those that train asks to run faster
        self.compiled = self.graphs = self.wgrad_stream = self.tuned = self.ema_compiled = False
        self.inductor_options: dict[str, dict[str, object]] = {}
        self.student_forward, self.teacher_forward = student, teacher
        self.student_inputs, self.loss_terms, self.ema = student_inputs, loss_terms, ema_update_
        self.teacher_stream: torch.cuda.Stream | None = None
        self.step_graph = None   # trainables.fast.step_graph.StepGraph: the whole step as one CUDA graph
        self.update_parts = None   # (early, late) parts of the update around the weight-gradient stream's join
        if cfg.train.fast:
            speed_up(self)
        self.generator = torch.Generator(device=device)   # one object for the run: a captured step holds it
        self.sums: dict[str, torch.Tensor] = {}
        self.reset_metrics()
        # {time/first_step_s, time/compile_wait_s} once the first step (compilation, cuDNN tuning, capture) ran
        self.first_step: dict[str, float] | None = None

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

    def _x(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous(memory_format=self.memory_format)

    def student_logits(self, inputs: list[torch.Tensor], segments: list[tuple[int, bool]],
                       stacked: bool) -> list[torch.Tensor]:
        """The student's logits for each (batch size, updates BN running stats) in the reference's call order,
        from ``student_inputs``: one ``stacked`` batch, called once with per-batch batch-norm statistics, or one
        batch per call."""
        if stacked:
            with batch_segments(self.stacked_bns, tuple(segments)), self.autocast:
                logits = self.student_forward(inputs[0])
            return list(logits.split([n for n, _ in segments]))
        out = []
        for x, (_, update) in zip(inputs, segments):
            with (contextlib.nullcontext() if update else frozen_bn_stats(self.student)), self.autocast:
                out.append(self.student_forward(x))
        return out

    def teacher_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The teacher's logits, float32 or wider (eval mode, no gradient), launched on the teacher's stream if it
        has one: the caller's stream must wait for that stream before it reads them."""
        stream = self.teacher_stream
        if stream is None:
            with torch.no_grad(), self.autocast:
                return wide(self.teacher_forward(self._x(x)))
        # The teacher stream starts after all work queued so far (this step's batch, the last EMA update) and
        # allocates only here: a block it frees is reused by it after its next wait, when the main stream's
        # reads of the last step's logits are queued before that point.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.no_grad(), self.autocast:
            return wide(self.teacher_forward(self._x(x)))

    def losses(self, batch: Batch, gen: torch.Generator, supervised: bool = True
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Total loss and its detached parts for one batch; ``supervised=False`` leaves out the labeled part."""
        cfg = self.cfg
        perturb = cfg.perturb.regularizer if cfg.perturb is not None else None
        mix = cfg.mix.regularizer if cfg.mix is not None else None
        teacher_logits = None
        if perturb is not None or mix is not None:
            teacher_logits = self.teacher_logits(batch.x_unsup0)
        # With both paths on, the reference keeps BN running stats from the erasure call only.
        segments = [(batch.x_sup.shape[0], True)] if supervised else []
        segments += [(batch.x_unsup1.shape[0], True)] if perturb is not None else []
        segments += [(batch.x_unsup0.shape[0], perturb is None)] if mix is not None else []
        stacked = self.stacked_bns is not None and len(segments) > 1
        inputs, blend = self.student_inputs(
            batch.x_sup if supervised else None, batch.x_unsup1, batch.x_unsup0,
            perturb, perturb.draw(batch.x_unsup1, gen) if perturb is not None else None,
            mix, mix.draw(batch.x_unsup0, gen) if mix is not None else None,
            stacked, self.memory_format == torch.channels_last)
        logits = self.student_logits(inputs, segments, stacked)
        if self.teacher_stream is not None and teacher_logits is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.teacher_stream)
        return self.loss_terms(logits, teacher_logits, batch.y_sup if supervised else None, blend,
                               cfg.perturb, cfg.mix, device_constants(path_numbers(cfg), self.device))

    def step(self, batch: Batch, gen: torch.Generator, lr: float, alpha: float) -> None:
        """One optimiser step and one teacher update."""
        if self.first_step is None:
            self._first_step(batch, gen, lr, alpha)
        else:
            self._step(batch, gen, lr, alpha)

    def release_graphs(self) -> None:
        """Frees the whole-step CUDA graph, if captured (the next step captures again): before a data-parallel
        worker's process group is destroyed (``StepGraph.release``)."""
        if self.step_graph is not None:
            self.step_graph.release()

    def _first_step(self, batch: Batch, gen: torch.Generator, lr: float, alpha: float) -> None:
        """The first step compiles (``first_step_lock``: on CUDA alone of the processes on the machine)."""
        t0 = time.monotonic()
        lock = first_step_lock(self, batch) if self.cfg.train.fast else contextlib.nullcontext({"waited_s": 0.0})
        with lock as waited:
            self._step(batch, gen, lr, alpha)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)   # its cuDNN tuning too, before the next trial's
        self.first_step = {M.FIRST_STEP_S: time.monotonic() - t0 - waited["waited_s"],
                           M.COMPILE_WAIT_S: waited["waited_s"]}

    def _step(self, batch: Batch, gen: torch.Generator, lr: float, alpha: float) -> None:
        if self.step_graph is not None:
            return self.step_graph.step(self, batch, gen, lr, alpha)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()  # outputs of the last step's graphs may be reused
        loss, stats = self.losses(batch, gen)
        self.optimizer.zero_grad(set_to_none=True)
        with backward_on_side(self.wgrad_stream, self.device):   # joined when it ends
            loss.backward()
        if self.grad_sync is not None:
            self.grad_sync(self.student)
        self.optimizer.step()
        if self.ema_compiled:
            self.ema(self.pairs, *(torch.full((), v, device=self.device) for v in (alpha, ema_weight(alpha))))
        else:
            ema_update_(self.pairs, alpha)
        self.add_stats(stats)
        self.count += 1

    def add_stats(self, stats: dict[str, torch.Tensor]) -> None:
        """Add a step's metrics to the running sums, in one fused kernel."""
        keys = list(stats)
        torch._foreach_add_([self.sums[k] for k in keys], [stats[k] for k in keys])


@torch.no_grad()
def evaluate(model: nn.Module, batches, autocast, memory_format) -> tuple[float, float]:
    """(top-1 error, mean cross-entropy) of ``model`` over (x, y) batches; one host sync at the end."""
    was_training = model.training
    model.eval()
    wrong = torch.zeros((), dtype=torch.float64)
    loss_sum = torch.zeros((), dtype=torch.float64)
    n = 0
    for x, y in batches:
        with autocast:
            logits = model(x.contiguous(memory_format=memory_format)).float()
        if wrong.device != logits.device:
            wrong, loss_sum = wrong.to(logits.device), loss_sum.to(logits.device)
        wrong += (logits.argmax(1) != y).sum()
        loss_sum += F.cross_entropy(logits, y, reduction="sum").double()
        n += y.shape[0]
    model.train(was_training)
    if n == 0:
        return float("nan"), float("nan")
    return (wrong / n).item(), (loss_sum / n).item()
