"""How Inductor compiles a run's student, teacher and step glue: the options of each compile (combo kernels,
programmatic dependent launch, the realize-reads threshold, coordinate-descent tuning, what the weight-gradient
stream needs) and the models each option was measured to pay for. None of it changes what a step computes.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from trainables.config import TrainConfig

# The models compiled with Inductor's combo_kernels on a GPU unless train.fast.combo_kernels says otherwise:
# independent small kernels (each batch norm's running-statistics update, weight casts, ...) launched as
# one. Measured in the captured CowMix step (benchmarks/step_ab.py, 2026-11-27): WRN-28-2 171.8 -> 178.2
# steps/s on an H100, 186.2 -> 192.1 on an H200; the shake-shake WRN-26 22.9 -> 22.1 on an H200 (why was
# not looked into), so it stays off there.
COMBO_KERNEL_MODELS = frozenset({"wrn28_2"})

# The models whose Inductor kernels launch with programmatic dependent launch (Inductor's triton.enable_pdl, used on
# Hopper or newer GPUs) unless train.fast.dependent_launch says otherwise: each kernel waits for the one before it
# inside the kernel (griddepcontrol) instead of at its launch, so its blocks start while the previous kernel's last
# blocks finish. Measured in the captured CowMix step (benchmarks/step_ab.py --untuned, one process, H200, 2026-11-28,
# before it was on by default; now --variants no-pdl,pdl): WRN-28-2 218.1 -> 220.8 steps/s (every round); the
# shake-shake WRN-26 28.7 -> 28.5 (every round), so it stays off there. On vs off, six deterministic WRN-28-2 steps
# gave the same weights (gpu_checks.py dependent_launch), and so did six of the shake-shake WRN-26 2x32d once both
# compiles ran under Inductor's deterministic mode (dependent_launch_shakeshake, H200, 2026-11-28; without it, two
# compiles that time reductions' block sizes had left them 2.9e-6 apart).
DEPENDENT_LAUNCH_MODELS = frozenset({"wrn28_2"})

# Inductor's realize_reads_threshold for a model's student and teacher where it differs from the 8 the trainer sets
# for every compile (below: bn_relu's masked gradient in WRN-28-2); train.fast.realize_reads_threshold overrides it.
# Inductor recomputes a pointwise result that several kernels read, instead of storing it, while it reads at most
# that many buffers. In the shake-shake model the gradient down the residual chain (the block's output gradient plus
# the masked input gradient of its first convolution) gains two reads a block, so under 8 it went unstored for four
# blocks and each kernel of those blocks read every partial gradient again: the backward's Inductor kernels moved
# 28 GB a step, one of them 1.7 GB. Under 4 it is stored every other block: the CowMix step 24.5 -> 26.1 steps/s
# (H100, 2026-11-27, student and teacher together; the teacher, which has no backward, was not measured alone;
# docs/journal/2026-11-27.md). Since then FastShakeShakeBlock.store_input_grad stores it at every block whatever the
# threshold, and 4 still measured a little faster than 8 (26.4 against 26.2 steps/s, untuned).
REALIZE_READS_BY_MODEL = MappingProxyType({"wrn26_6_shakeshake": 4, "wrn26_2_shakeshake": 4, "wrn20_6_shakeshake": 4})

def realize_reads_wanted(cfg: TrainConfig) -> int | None:
    """``train.fast.realize_reads_threshold``, or where it is None, the model's entry in ``REALIZE_READS_BY_MODEL``
    (None: the trainer's global setting)."""
    if cfg.train.fast.realize_reads_threshold is not None:
        return cfg.train.fast.realize_reads_threshold
    return REALIZE_READS_BY_MODEL.get(cfg.model)


def _setting_or_model_in(setting: bool | None, cfg: TrainConfig, models: frozenset[str]) -> bool:
    """``setting`` where the config sets it, else whether the config's model is one of ``models`` (those the
    setting was measured to pay for)."""
    return setting if setting is not None else cfg.model in models


def combo_kernels_wanted(cfg: TrainConfig) -> bool:
    """``train.fast.combo_kernels``, or where it is None, whether the model is one they were measured to pay for."""
    return _setting_or_model_in(cfg.train.fast.combo_kernels, cfg, COMBO_KERNEL_MODELS)


def dependent_launch_wanted(cfg: TrainConfig) -> bool:
    """``train.fast.dependent_launch``, or where it is None, whether the model is one it was measured to pay for."""
    return _setting_or_model_in(cfg.train.fast.dependent_launch, cfg, DEPENDENT_LAUNCH_MODELS)


# What train.fast.tune_kernels None means in this process: on, except where a search runs its trials (its trial
# workers and its compile-ahead process turn it off with ``tune_kernels_by_default``)
_TUNE_BY_DEFAULT = True


def tune_kernels_by_default(on: bool) -> None:
    """Set what ``train.fast.tune_kernels`` None means in this process (the configs themselves keep None, so a
    promoted trial's config tunes in its final training)."""
    global _TUNE_BY_DEFAULT
    _TUNE_BY_DEFAULT = on


def tune_kernels_wanted(cfg: TrainConfig) -> bool:
    """``train.fast.tune_kernels``, or where it is None, whether the run is not ``train.deterministic`` (the tuned
    block sizes are measured, so another machine may pick others and round differently) and not a search's trial: each
    trial's gain is smaller than what the tuning adds to the first compile, which every trial waits for.

    Inductor's coordinate-descent tuning times each Triton kernel of the student and the teacher with neighbouring
    block sizes at its first launch and keeps the fastest; the choices are cached on the machine, so only the first
    compile there pays (WRN-28-2 CowMix on an H100, 2026-11-27: +1.7% steps/s in the step, 203.3 against 199.9;
    its first compile some 100 s longer)."""
    if cfg.train.fast.tune_kernels is not None:
        return cfg.train.fast.tune_kernels
    return _TUNE_BY_DEFAULT and not cfg.train.deterministic


def inductor_options(mode: str, device: torch.device, combo: bool, wgrad_stream: bool = False,
                     dependent_launch: bool = False) -> dict[str, object]:
    """The options a model is compiled with (options of its own torch.compile call, so that Dynamo compiles it
    afresh rather than reusing code compiled under other options, as a global Inductor setting would):
    ``mode``'s; on a GPU, ``combo`` kernels or not, and programmatic ``dependent_launch`` or not; and, for a
    student whose weight gradients run on a side stream (trainables.fast.wgrad_stream), no reuse of a buffer, nor
    writing into one in place, that the side stream may still be reading."""
    from torch._inductor import list_mode_options

    gpu = {"combo_kernels": combo, "triton.enable_pdl": dependent_launch} if device.type == "cuda" else {}
    return {**list_mode_options(mode), **gpu,
            **({"allow_buffer_reuse": False, "inplace_buffers": False} if wgrad_stream else {})}


def allow_custom_functions_in_compile_cache() -> None:
    """Let AOTAutograd cache graphs that hold a custom ``autograd.Function`` (off by default in PyTorch):
    without it the student's training graph, which holds ``SegmentedBatchNorm2d``'s one-pass function,
    is traced and partitioned again by every new process, even when Inductor's cache has its kernels.
    Dynamo traces the function's forward and backward into the graph, so they are part of the cache key."""
    import torch._functorch.config as functorch

    if hasattr(functorch, "autograd_cache_allow_custom_autograd_functions"):   # absent in older PyTorch
        functorch.autograd_cache_allow_custom_autograd_functions = True
