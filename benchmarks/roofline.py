"""Count FLOPs and bytes of every aten op in one training step, and its roofline time.

The roofline time of a step is the sum over its kernels of max(flops / peak_flops,
bytes / peak_bandwidth): what the step would take if every kernel ran at the better of the two
hardware limits and nothing else cost time. Bytes are each op's tensor inputs plus outputs
(an upper bound for fused kernels, a lower bound for ones that re-read their inputs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

# Dense bf16 tensor-core peak and HBM bandwidth, from the vendors' datasheets (SXM parts).
PEAKS = {
    "H100": (989e12, 3.35e12),
    "H200": (989e12, 4.8e12),
    "A100": (312e12, 2.0e12),
}


def device_peaks(device: torch.device) -> tuple[str, float, float] | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (flops, bw) in PEAKS.items():
        if key in name:
            return name, flops, bw
    return None


@dataclass
class OpCost:
    flops: float = 0.0
    bytes: float = 0.0
    roofline_s: float = 0.0
    ops: int = 0


class CostRecorder(TorchDispatchMode):
    """Accumulate FLOPs, bytes and roofline time of every op dispatched while active."""

    def __init__(self, peak_flops: float, peak_bw: float):
        super().__init__()
        self.peak_flops, self.peak_bw = peak_flops, peak_bw
        self.total = OpCost()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        flops = 0.0
        if packet in flop_registry:
            try:
                flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
            except TypeError:
                flops = float(flop_registry[packet](*args, **kwargs))
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        nbytes = float(sum(t.numel() * t.element_size() for t in tensors))
        self.total.flops += flops
        self.total.bytes += nbytes
        self.total.roofline_s += max(flops / self.peak_flops, nbytes / self.peak_bw)
        self.total.ops += 1
        return out


def measure_step_cost(step_fn, peak_flops: float, peak_bw: float) -> OpCost:
    """Run ``step_fn()`` once eagerly under the recorder."""
    with CostRecorder(peak_flops, peak_bw) as rec:
        step_fn()
    return rec.total
