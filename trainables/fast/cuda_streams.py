"""CUDA streams shared by the runners of a process, one per (device, role): the teacher's, the step graph's
warm-up and capture streams, and the weight gradients' side stream (``trainables.fast.wgrad_stream``).

A trial worker that Ray reuses builds a new ``StepRunner`` for each trial. PyTorch gives every CUDA stream
that runs a cuBLAS call a cuBLAS and a cuBLASLt workspace of its own (tens of MiB on an H100), kept in a
static map until the process ends; its stream pool hands out 32 streams per priority in turn, so streams
made anew for each runner add workspaces until the pool has gone round. Measured on an H100 while each
runner still made its own (2026-11-27, with the probe that became ``benchmarks/runner_memory.py``): a
dropped runner left 163 MiB counted as allocated with the step graph (three new streams a runner), 33 MiB
without it (one, the teacher's). The streams here are made once and reused.
"""
from __future__ import annotations

import torch

_STREAMS: dict[tuple[int, str], torch.cuda.Stream] = {}


def shared_stream(device: torch.device, role: str, priority: int = 0) -> torch.cuda.Stream:
    """The process's stream for ``role`` on ``device``, made at the first call, with ``priority`` (lower is
    higher, 0 the default; PyTorch's range is 0 down to -1 or lower). A role has one priority."""
    index = torch.device(device).index
    key = (torch.cuda.current_device() if index is None else index, role)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(key[0], priority=priority)
    elif _STREAMS[key].priority != priority:
        raise ValueError(f"the {role!r} stream of cuda:{key[0]} has priority {_STREAMS[key].priority}, "
                         f"not {priority}")
    return _STREAMS[key]
