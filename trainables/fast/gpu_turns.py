"""Trials packed on one GPU take turns with it, an epoch's steps at a time, instead of time-slicing it.

Processes that share a GPU without MPS are time-sliced: the GPU switches between their contexts
every few milliseconds, and each switch drains and restores work. Four packed WRN-28-2 CowMix trials
on an H100 stepped at 133 steps/s together against 142 for one alone. With turns, one trial at a
time runs its epoch's steps with the GPU to itself, while the others evaluate, checkpoint, report
or wait; what still overlaps is their evaluation and a new trial's first step (compilation, mostly
on the CPU). On one H100, 2, 4 and 8 trials taking turns delivered 134.9-135.5 steps/s with their
evaluations, time-sliced 119.9-122.5, and one trial alone 126.8 (``benchmarks/packing.py``). The turn is an
exclusive ``flock`` on a file named after the user and the GPU's UUID, so it holds across processes
and Ray workers on one machine; the kernel releases it if its holder dies.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import torch

from trainables.file_locks import exclusive


def gpu_identity(device: torch.device) -> str:
    """The GPU's UUID (the same whatever CUDA_VISIBLE_DEVICES makes its index), else its name and index."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    uuid = str(getattr(props, "uuid", "") or "")
    return uuid or f"{props.name}-{index}".replace(" ", "_")


def gpu_turn(identity: str) -> contextlib.AbstractContextManager[dict[str, float]]:
    """Hold the turn on the GPU named ``identity`` for the body; yields {"waited_s": seconds waited for it}.
    The body must finish its GPU work (synchronise) before it ends, or the next holder overlaps it."""
    # per user: another user's lock file would not open for writing (their trials then time-slice with ours)
    return exclusive(Path(tempfile.gettempdir()) / f"cowtune-gpu-turn-{os.getuid()}-{identity}.lock")
