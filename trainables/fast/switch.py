"""The one door between the trainer core and the speed machinery.

The core (``trainables.step``, ``trainables.trainer``) imports from ``trainables.fast`` only through this module:

* ``prepare_student(student, cfg, device)``: the student's convolutions switched to our Triton kernels and to the
  weight-gradient stream, where ``train.conv_kernels`` and ``train.wgrad_stream`` ask for them;
* ``speed_up(runner)``: a ``StepRunner`` built as the plain step (eager, one call each, nothing on other streams)
  given what ``train`` asks for: compiled models, masks, losses and EMA, the teacher on its own CUDA stream, the
  whole step as one CUDA graph, the update in two parts around the weight-gradient stream's join;
* ``first_step_lock(runner, batch)``: the machine's first-compile lock around a runner's first step;
* ``backward_on_side``, ``gpu_identity``, ``gpu_turn``: the weight-gradient stream around a backward pass, and the
  turns that trials packed on one GPU take.

With ``train.fast`` false the config leaves all of it off (``trainables.config.PLAIN_TRAIN``) and the runner does
not call ``speed_up``: the step is the plain specification. None of it changes what a step computes; the tests
compare the two.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

import torch
from torch import nn

from trainables.fast.compile_lock import first_compile_lock, operators_version, step_key
from trainables.fast.compile_options import (GRAPH_SWITCH_OWNERS, allow_custom_functions_in_compile_cache,
                                            combo_kernels_wanted, dependent_launch_wanted, inductor_options,
                                            realize_reads_wanted, tune_kernels_wanted)
from trainables.fast.cuda_streams import shared_stream
from trainables.fast.fast_conv import apply_conv_kernels
from trainables.fast.gpu_turns import gpu_identity, gpu_turn
from trainables.fast.split_update import split_update
from trainables.fast.step_graph import StepGraph
from trainables.fast.stored_grad import register_lowering as register_store_lowering
from trainables.fast.wgrad_stream import apply_wgrad_stream, backward_on_side, side_stream_wanted

if TYPE_CHECKING:
    from trainables.config import TrainConfig
    from trainables.data import Batch
    from trainables.step import StepRunner

__all__ = ["Switches", "backward_on_side", "compile_key", "first_step_lock", "gpu_identity", "gpu_turn",
           "prepare_student", "speed_up"]


class Switches:
    """Process-wide switches of the fast path, for A/B timings (``benchmarks/step_ab.py``); read by ``speed_up``."""
    compile_ema = True   # the teacher EMA compiled with the glue (off: eager foreach calls)
    update_in_parts = True   # a captured step with the weight-gradient stream updates in two parts (off: one)
    # Inductor options applied last, over the trainer's own, to the student and teacher of each runner built while it
    # is set (and so in their compile key): empty in the trainer; benchmarks/step_ab.py's inductor: variants set it
    extra_inductor_options: dict[str, object] = {}


def prepare_student(student: nn.Module, cfg: TrainConfig, device: torch.device) -> None:
    """Switch the student's convolutions as ``train.conv_kernels`` and ``train.wgrad_stream`` ask (before it is
    copied into the teacher and given to the optimiser: the switched layers keep their parameters)."""
    apply_conv_kernels(student, cfg.train.conv_kernels, cfg.train.cuda_graph, device)
    apply_wgrad_stream(student, cfg.train.wgrad_stream, cfg.train.cuda_graph, device)   # the other convolutions


def speed_up(r: StepRunner) -> None:
    """Give the plain runner ``r`` the fast path's parts that ``r.cfg.train`` asks for on ``r.device``."""
    cfg, device = r.cfg, r.device
    compiled = cfg.train.compile if cfg.train.compile is not None else device.type == "cuda"
    mode = cfg.train.compile_mode if device.type == "cuda" else "default"
    if r.cuda_graph != "model":  # torch.compile's own CUDA graphs cannot sit inside another capture
        mode = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}.get(mode, mode)
    r.compiled = compiled
    r.graphs = compiled and mode in ("reduce-overhead", "max-autotune")  # the modes that replay CUDA graphs
    # Static shapes: the student and teacher share one forward, so the teacher's call (one batch) and the
    # student's stacked call (two or three) would otherwise make Dynamo recompile with a symbolic batch
    # size, and Inductor cannot split the batch-norm reductions of a symbolic size (2x slower on an H100).
    # Weight gradients on a side stream (trainables.fast.wgrad_stream): the student's compiled backward must then
    # not reuse a buffer, or write into one in place, that the side stream may still be reading (options of
    # its own compilation: Dynamo compiles afresh for them, where a global setting would let a model built
    # later in the process reuse code compiled before it, under the other setting)
    r.wgrad_stream = side_stream_wanted(cfg.train.wgrad_stream, r.cuda_graph, compiled,
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
    combo = combo_kernels_wanted(cfg)
    pdl = dependent_launch_wanted(cfg)
    r.inductor_options = {name: inductor_options(mode, device, combo, name == "student" and r.wgrad_stream, pdl)
                          for name in ("student", "teacher")} if compiled else {}
    reads = realize_reads_wanted(cfg)
    if reads is not None:
        for options in r.inductor_options.values():
            options["realize_reads_threshold"] = reads
    r.tuned = compiled and device.type == "cuda" and tune_kernels_wanted(cfg)
    if r.tuned:
        for options in r.inductor_options.values():
            options["coordinate_descent_tuning"] = True
    for options in r.inductor_options.values():
        options.update(Switches.extra_inductor_options)
    if compiled:
        r.student_forward = torch.compile(r.student, dynamic=False, options=r.inductor_options["student"])
        r.teacher_forward = torch.compile(r.teacher, dynamic=False, options=r.inductor_options["teacher"])
    glue = compiled and cfg.train.compile_masks_and_losses
    if glue:
        r.student_inputs = torch.compile(r.student_inputs, dynamic=False)   # the plain step's functions
        r.loss_terms = torch.compile(r.loss_terms, dynamic=False)
    # The EMA over ~170 tensors: eagerly 6-7 foreach kernels, three passes over the teacher, at the very end of
    # the step; compiled, one pass (alpha and 1 - alpha as device scalars, so one compilation for every alpha)
    r.ema_compiled = glue and Switches.compile_ema
    if r.ema_compiled:
        r.ema = torch.compile(r.ema, dynamic=False)
    # The teacher's forward needs only the unperturbed batch: on its own CUDA stream it overlaps the
    # masks and the student's forward, and the main stream waits for it before the losses.
    # (Not under torch.compile's own CUDA graphs, which replay on their own stream.)
    r.teacher_stream = shared_stream(device, "teacher") if device.type == "cuda" and not r.graphs else None
    r.step_graph = StepGraph(device) if r.cuda_graph == "step" else None
    # (early, late) parts of the optimiser update and EMA, around the weight-gradient stream's join
    r.update_parts = split_update(r.optimizer, r.pairs, r.student) \
        if Switches.update_in_parts and r.wgrad_stream and r.step_graph is not None and r.grad_sync is None \
        else None   # (an all-reduce needs every gradient before any update)


def compile_locked(r: StepRunner) -> bool:
    """Whether the runner's first step compiles under the machine's first-compile lock. Not for data-parallel
    replicas: they meet in collectives during the step, and one waiting for the lock while the holder waits for it
    in an all-reduce would never finish."""
    return r.compiled and r.device.type == "cuda" and r.grad_sync is None


def compile_key(r: StepRunner, batch: Batch) -> str:
    """What the runner's compiled graphs depend on, as the first-compile lock names it."""
    cfg = r.cfg
    return step_key(torch.__version__, operators_version(),
                    torch.cuda.get_device_name(r.device) if compile_locked(r) else "",
                    cfg.method, [(n, tuple(p.shape)) for n, p in r.student.named_parameters()],
                    [(tuple(x.shape), x.dtype) for x in (batch.x_sup, batch.x_unsup0, batch.x_unsup1)],
                    cfg.train.compile_mode, r.cuda_graph, cfg.train.stack_student_calls, cfg.train.bn_batch,
                    r.memory_format, r.bf16, cfg.train.conv_kernels, r.wgrad_stream,
                    cfg.train.compile_masks_and_losses, r.ema_compiled, r.update_parts is not None,
                    sorted(r.inductor_options.get("student", {}).items()),
                    [[getattr(owner, s) for s in owner.COMPILE_KEY_SWITCHES] for owner in GRAPH_SWITCH_OWNERS])


@contextlib.contextmanager
def first_step_lock(r: StepRunner, batch: Batch) -> Iterator[dict[str, float]]:
    """Around the runner's first step, which compiles: on CUDA the machine's first-compile lock, so that of trials
    packed on one GPU the first compiles alone and the others then load the kernels it cached
    (``trainables.fast.compile_lock``). Yields ``{"waited_s": ...}``."""
    with first_compile_lock(compile_key(r, batch), compile_locked(r)) as lock:
        yield lock
