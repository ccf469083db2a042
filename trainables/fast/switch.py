"""The one door between the trainer core and the speed machinery.

The core (``trainables.step``, ``trainables.trainer``) imports from ``trainables.fast`` only through this module:

* ``fast_path(cfg, switches)``: the one place that reads ``train.fast.enabled``: ``FAST_PATH`` when it is on (made
  with ``switches``, a ``FastSwitches``: the fast path's A/B switches, which benchmarks pass to
  ``trainer.build_runner``; the trainer keeps their defaults), None for the plain step. The trainer and
  ``trainables.evaluate`` enter the rest through what it gives:
* ``prepare_student(student, cfg, device)``: the student's blocks switched to their fast variants (``model_swaps``),
  and its convolutions to our Triton kernels and to the weight-gradient stream, where ``train.fast.conv_kernels`` and
  ``train.fast.wgrad_stream`` ask for them;
* ``speed_up_model``: the blocks' fast variants alone, for a model that only evaluates (``trainables.evaluate``);
* ``FastStep(train_step, runner)``: the plain step, ``trainables.step.train_step``, made fast as ``train`` asks:
  that same function called with other kernels (compiled models, masks, losses and EMA, the teacher on its own CUDA
  stream, the update in two parts around the weight-gradient stream's join) and its numbers as device tensors, or
  the whole of it captured in one CUDA graph and replayed (``step_graph``). The runner takes it as ``fast`` and
  calls it in place of the plain step; nothing here sets anything on the runner;
* ``FastStep.first_step_lock``: the machine's first-compile lock around a runner's first step;
* ``backward_on_side``, ``gpu_identity``, ``gpu_turn``: the weight-gradient stream around a backward pass, and the
  turns that trials packed on one GPU take.

With ``train.fast.enabled`` false the config leaves all of it off (``trainables.config.PLAIN_FAST``) and
``fast_path`` gives None: the trainer does not hand the runner a ``FastStep``, the step is the plain specification.
None of it changes what a step computes; the tests compare the two. ``train_step`` comes in as an argument:
``fast`` does not import the core.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple

import torch
from torch import Tensor, nn

from trainables.fast.compile_lock import first_compile_lock, operators_version, step_key
from trainables.fast.compile_options import (allow_custom_functions_in_compile_cache, combo_kernels_wanted,
                                            dependent_launch_wanted, inductor_options, realize_reads_wanted,
                                            tune_kernels_wanted)
from trainables.fast.cuda_streams import shared_stream
from trainables.fast.device_numbers import draws_on_device, on_device
from trainables.fast.fast_conv import apply_conv_kernels
from trainables.fast.gpu_turns import gpu_identity, gpu_turn
from trainables.fast.model_swaps import model_switches, speed_up_model
from trainables.fast.split_update import UpdatePart, sgd_part_, split_update
from trainables.fast.step_graph import StepGraph
from trainables.fast.stored_grad import register_lowering as register_store_lowering
from trainables.fast.wgrad_stream import apply_wgrad_stream, backward_on_side, side_stream_wanted
from trainables.ssl.ema import EmaPairs, ema_update_, ema_weight, teacher_logits

if TYPE_CHECKING:
    from trainables.config import TrainConfig
    from trainables.data import Batch
    from trainables.step import StepRunner

__all__ = ["FAST_PATH", "FastPath", "FastStep", "FastSwitches", "backward_on_side", "compile_key", "fast_path",
           "gpu_identity", "gpu_turn", "prepare_student", "speed_up_model"]


@dataclasses.dataclass(frozen=True)
class FastSwitches:
    """The fast path's A/B switches, one runner's (``fast_path(cfg, switches)``, ``trainer.build_runner``): the
    defaults are the trainer's step; ``benchmarks/step_ab.py``'s variants turn one off to time it. Not in the config:
    none of them changes what a step computes, nor is any meant to be tuned. Each is part of the first-compile key
    (``compile_key``) where it differs from its default."""
    compile_ema: bool = True   # the teacher EMA compiled with the glue (off: eager foreach calls)
    update_in_parts: bool = True   # a captured step with the weight-gradient stream updates in two parts (off: one)
    teacher_stream: bool = True   # the teacher on its own CUDA stream where it can be (off: on the step's stream)
    capture_priority: bool = True   # the step graph captured on a high-priority stream (off: the default priority)
    # also switch convolutions with a bias and the models' SameConv2d layers at stride 1 to the row kernels
    # (``fast_conv.eligible``): in the shake-shake WRN-26 96x2d its stem and its first block's 16 -> 96 convolutions,
    # which then run one by one, not stacked (H200: 28.5 -> 28.7 steps/s, docs/journal/2026-11-28.md); in the 2x32d
    # model, the stem and every stride-1 layer (32-128 channels: the WRN-28-2 kernels' shapes; not measured in its
    # step); off: nn.Conv2d without bias only
    same_and_biased: bool = True
    # Inductor options applied last, over the trainer's own, to the student's and the teacher's compile (and so in
    # their compile key): empty in the trainer; benchmarks/step_ab.py's inductor: variants set them
    extra_inductor_options: Mapping[str, object] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:   # a copy, read-only: the caller's dict may change, these may not
        object.__setattr__(self, "extra_inductor_options", MappingProxyType(dict(self.extra_inductor_options)))

    def changed(self) -> tuple[tuple[str, object], ...]:
        """(name, value) of each switch that differs from its default, in field order (Inductor options sorted)."""
        out = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            if value != default:
                out.append((f.name, sorted(value.items()) if isinstance(value, Mapping) else value))
        return tuple(out)


DEFAULT_SWITCHES = FastSwitches()


def prepare_student(student: nn.Module, cfg: TrainConfig, device: torch.device,
                    switches: FastSwitches = DEFAULT_SWITCHES) -> None:
    """Switch the student's blocks to their fast variants, and its convolutions as ``train.fast.conv_kernels`` and
    ``train.fast.wgrad_stream`` ask (before it is copied into the teacher and given to the optimiser: the switched
    modules keep their parameters); which convolutions the row kernels take, as ``switches.same_and_biased`` asks."""
    fast = cfg.train.fast
    speed_up_model(student)
    apply_conv_kernels(student, fast.conv_kernels, fast.cuda_graph, device, switches.same_and_biased)
    apply_wgrad_stream(student, fast.wgrad_stream, fast.cuda_graph, device)   # the other convolutions


class FastStep:
    """``train_step`` made fast for the runner ``r`` as ``r.cfg.train.fast`` asks on ``r.device``, with ``switches``;
    called as ``fast(r, batch, gen, lr, alpha)`` in place of the plain step. It keeps no reference to the runner (nor
    do its kernels), so a dropped runner frees its captured graph's memory at once."""

    def __init__(self, train_step: Callable[..., None], r: StepRunner, switches: FastSwitches = DEFAULT_SWITCHES):
        cfg, fast, device = r.cfg, r.cfg.train.fast, r.device
        self.train_step = train_step
        self.switches = switches
        compiled = fast.compile if fast.compile is not None else device.type == "cuda"
        mode = fast.compile_mode if device.type == "cuda" else "default"
        if r.cuda_graph != "model":  # torch.compile's own CUDA graphs cannot sit inside another capture
            mode = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}.get(mode, mode)
        self.compiled = compiled
        self.graphs = compiled and mode in ("reduce-overhead", "max-autotune")  # the modes that replay CUDA graphs
        # Static shapes: the student and teacher share one forward, so the teacher's call (one batch) and the
        # student's stacked call (two or three) would otherwise make Dynamo recompile with a symbolic batch
        # size, and Inductor cannot split the batch-norm reductions of a symbolic size (2x slower on an H100).
        # Weight gradients on a side stream (trainables.fast.wgrad_stream): the student's compiled backward must then
        # not reuse a buffer, or write into one in place, that the side stream may still be reading (options of
        # its own compilation: Dynamo compiles afresh for them, where a global setting would let a model built
        # later in the process reuse code compiled before it, under the other setting)
        self.wgrad_stream = side_stream_wanted(fast.wgrad_stream, r.cuda_graph, compiled,
                                               r.stacked_bns is not None, r.student)
        if compiled:   # one compiled entry per (mode, batch size): a reused Ray actor may meet several sizes,
            # and past the limit Dynamo would quietly run the model eagerly
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            # Inductor stores a pointwise result that two kernels read once it reads more than 4 buffers: the
            # ReLU-masked gradient in bn_relu's backward reads 4-8, and recomputing it inside both backward
            # kernels is one pass less per layer (WRN-28-2 CowMix, H100: 132.5 -> 139.4 steps/s with bn_relu)
            import torch._inductor.config as inductor
            inductor.realize_reads_threshold = max(inductor.realize_reads_threshold, 8)
            allow_custom_functions_in_compile_cache()
            register_store_lowering()
        self.inductor_options = self._inductor_options(cfg, device, mode) if compiled else {}
        self.tuned = compiled and device.type == "cuda" and tune_kernels_wanted(cfg)
        student, teacher = r.student, r.teacher
        if compiled:
            student = torch.compile(r.student, dynamic=False, options=self.inductor_options["student"])
            teacher = torch.compile(r.teacher, dynamic=False, options=self.inductor_options["teacher"])
        self.student_forward, self.teacher_forward = student, teacher
        plain = r.kernels
        glue = compiled and fast.compile_masks_and_losses
        student_inputs = torch.compile(plain.student_inputs, dynamic=False) if glue else plain.student_inputs
        loss_terms = torch.compile(plain.loss_terms, dynamic=False) if glue else plain.loss_terms
        # The EMA over ~170 tensors: eagerly 6-7 foreach kernels, three passes over the teacher, at the very end of
        # the step; compiled, one pass (alpha and 1 - alpha as device scalars, so one compilation for every alpha)
        self.ema_compiled = glue and switches.compile_ema
        ema = torch.compile(ema_update_, dynamic=False) if self.ema_compiled else ema_update_
        # The teacher's forward needs only the unperturbed batch: on its own CUDA stream it overlaps the
        # masks and the student's forward, and the main stream waits for it before the losses.
        # (Not under torch.compile's own CUDA graphs, which replay on their own stream.)
        self.teacher_stream = shared_stream(device, "teacher") \
            if device.type == "cuda" and not self.graphs and switches.teacher_stream else None
        self.step_graph = StepGraph(device, switches.capture_priority) if r.cuda_graph == "step" else None
        # (early, late) parts of the optimiser update and EMA, around the weight-gradient stream's join
        self.update_parts = split_update(r.optimizer, r.pairs, r.student) \
            if switches.update_in_parts and self.wgrad_stream and self.step_graph is not None and r.grad_sync is None \
            else None   # (an all-reduce needs every gradient before any update)
        teacher_kernel = functools.partial(teacher_logits, teacher, r.autocast, r.memory_format)
        if self.teacher_stream is not None:
            teacher_kernel = functools.partial(_on_stream, self.teacher_stream, device, teacher_kernel)
            loss_terms = functools.partial(_after_stream, self.teacher_stream, device, loss_terms)
        if self.update_parts is not None:
            early, late = self.update_parts
            backward = functools.partial(_backward_then_part, self.wgrad_stream, device, r.optimizer, early, ema,
                                         self.step_graph.alpha)
            update = functools.partial(_update_part, late, ema)
        else:
            backward = functools.partial(_backward, device) if self.wgrad_stream else plain.backward
            update = functools.partial(_update, ema, device) if self.ema_compiled else plain.update
        self.kernels = dataclasses.replace(plain, student=student, teacher=teacher_kernel,
                                           draw=functools.partial(_draw_on_device, plain.draw), student_inputs=student_inputs,
                                           loss_terms=loss_terms, backward=backward, update=update)
        self.numbers = on_device(r.numbers, device)   # omega and psi

    def _inductor_options(self, cfg: TrainConfig, device: torch.device, mode: str) -> dict[str, dict[str, object]]:
        combo, pdl, reads = combo_kernels_wanted(cfg), dependent_launch_wanted(cfg), realize_reads_wanted(cfg)
        out = {name: inductor_options(mode, device, combo, name == "student" and self.wgrad_stream, pdl)
               for name in ("student", "teacher")}
        for options in out.values():
            if reads is not None:
                options["realize_reads_threshold"] = reads
            if device.type == "cuda" and tune_kernels_wanted(cfg):
                options["coordinate_descent_tuning"] = True
            options.update(self.switches.extra_inductor_options)
        return out

    def __call__(self, r: StepRunner, batch: Batch, gen: torch.Generator, lr: float, alpha: float) -> None:
        step = functools.partial(self.train_step, r, self.kernels, numbers=self.numbers)
        if self.step_graph is not None:
            return self.step_graph.step(step, r, batch, gen, lr, alpha)
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()  # outputs of the last step's graphs may be reused
        step(batch, gen, lr, alpha)

    def first_step_lock(self, r: StepRunner, batch: Batch) -> contextlib.AbstractContextManager[dict[str, float]]:
        """Around the runner's first step, which compiles: on CUDA the machine's first-compile lock, so that of
        trials packed on one GPU the first compiles alone and the others then load the kernels it cached
        (``trainables.fast.compile_lock``). Yields ``{"waited_s": ...}``."""
        return first_compile_lock(compile_key(r, batch), compile_locked(r))

    def release(self) -> None:
        """Frees the whole-step CUDA graph, if captured (``StepGraph.release``)."""
        if self.step_graph is not None:
            self.step_graph.release()


class FastPath(NamedTuple):
    """What the core calls when ``train.fast`` is on (``fast_path``)."""
    prepare_student: Callable[[nn.Module, TrainConfig, torch.device], None]   # a student before its teacher is made
    prepare_model: Callable[[nn.Module], nn.Module]   # a model that only evaluates: its fast blocks
    step: Callable[[Callable[..., None], StepRunner], FastStep]   # the runner's ``fast``: the plain step made fast


FAST_PATH = FastPath(prepare_student, speed_up_model, FastStep)


def fast_path(cfg: TrainConfig, switches: FastSwitches | None = None) -> FastPath | None:
    """``FAST_PATH`` when ``cfg.train.fast.enabled`` (with ``switches`` other than the defaults: a ``FastPath`` that
    prepares the student and makes the step with them), else None (the plain step: nothing of ``trainables.fast``
    runs). The one place that reads it; the speed settings' values are read where they are used.

    Raises:
        ValueError: ``switches`` other than the defaults for a config with ``train.fast.enabled`` false, where they
            would switch nothing.
    """
    switches = DEFAULT_SWITCHES if switches is None else switches
    if not cfg.train.fast.enabled:
        if switches != DEFAULT_SWITCHES:
            raise ValueError(f"fast-path switches {dict(switches.changed())} given for a config whose "
                             "train.fast.enabled is false: the plain step has none")
        return None
    if switches == DEFAULT_SWITCHES:
        return FAST_PATH
    return FastPath(functools.partial(prepare_student, switches=switches), speed_up_model,
                    functools.partial(FastStep, switches=switches))


def _draw_on_device(draw: Callable[..., dict[str, Any]], reg: Any, x: Tensor, gen: torch.Generator) -> dict[str, Any]:
    return draws_on_device(draw(reg, x, gen), x.device)


def _on_stream(stream: torch.cuda.Stream, device: torch.device, teacher: Callable[[Tensor], Tensor],
               x: Tensor) -> Tensor:
    """``teacher(x)`` launched on ``stream``: the caller's stream must wait for it before it reads the result."""
    # The teacher stream starts after all work queued so far (this step's batch, the last EMA update) and
    # allocates only here: a block it frees is reused by it after its next wait, when the main stream's
    # reads of the last step's logits are queued before that point.
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        return teacher(x)


def _after_stream(stream: torch.cuda.Stream, device: torch.device, loss_terms: Callable[..., Any],
                  logits: list[Tensor], teacher_logits: Tensor | None, *args: Any) -> Any:
    """``loss_terms`` once the current stream has waited for the teacher's logits on ``stream``."""
    if teacher_logits is not None:
        torch.cuda.current_stream(device).wait_stream(stream)
    return loss_terms(logits, teacher_logits, *args)


def _backward(device: torch.device, loss: Tensor) -> None:
    with backward_on_side(True, device):   # weight gradients on their own stream, joined when it ends
        loss.backward()


def _update(ema: Callable[..., None], device: torch.device, optimizer: torch.optim.Optimizer, pairs: EmaPairs,
            alpha: float | Tensor) -> None:
    """SGD, then ``ema`` with alpha and 1 - alpha as device scalars (compiled: one compilation for every alpha)."""
    optimizer.step()
    alpha = alpha if isinstance(alpha, Tensor) else torch.full((), alpha, device=device)
    ema(pairs, alpha, ema_weight(alpha))


def _backward_then_part(wgrad_stream: bool, device: torch.device, optimizer: torch.optim.SGD, early: UpdatePart,
                        ema: Callable[..., None], alpha: Tensor, loss: Tensor) -> None:
    """The backward pass and, before the weight-gradient stream's join, the update of what the main stream's
    gradients update (``trainables.fast.split_update``; in a captured step, whose alpha is the device scalar
    ``alpha``)."""
    with backward_on_side(wgrad_stream, device):
        loss.backward()
        _update_part(early, ema, optimizer, None, alpha)


def _update_part(part: UpdatePart, ema: Callable[..., None], optimizer: torch.optim.SGD, pairs: EmaPairs | None,
                 alpha: Tensor) -> None:
    """SGD and the EMA of ``part`` alone (``pairs``, the whole step's, is covered by the two parts together)."""
    sgd_part_(optimizer, part)
    ema(part.pairs, alpha, ema_weight(alpha))


def compile_locked(r: StepRunner) -> bool:
    """Whether the runner's first step compiles under the machine's first-compile lock. Not for data-parallel
    replicas: they meet in collectives during the step, and one waiting for the lock while the holder waits for it
    in an all-reduce would never finish."""
    return r.compiled and r.device.type == "cuda" and r.grad_sync is None


def compile_key(r: StepRunner, batch: Batch) -> str:
    """What the runner's compiled graphs depend on, as the first-compile lock names it."""
    cfg, settings, fast = r.cfg, r.cfg.train.fast, r.fast
    return step_key(torch.__version__, operators_version(),
                    torch.cuda.get_device_name(r.device) if compile_locked(r) else "",
                    cfg.method, [(n, tuple(p.shape)) for n, p in r.student.named_parameters()],
                    [(tuple(x.shape), x.dtype) for x in (batch.x_sup, batch.x_unsup0, batch.x_unsup1)],
                    settings.compile_mode, r.cuda_graph, settings.stack_student_calls, cfg.train.bn_batch,
                    r.memory_format, r.bf16, settings.conv_kernels, fast.wgrad_stream,
                    settings.compile_masks_and_losses, fast.ema_compiled, fast.update_parts is not None,
                    sorted(fast.inductor_options.get("student", {}).items()), model_switches(r.student),
                    # [[same_and_biased]] as the key spelled it when that was a class switch, then every switch
                    # that differs from its default: the defaults' key, and so the machine's first-compile markers,
                    # stay as they were
                    [[fast.switches.same_and_biased], *fast.switches.changed()])
