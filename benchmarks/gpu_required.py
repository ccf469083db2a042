"""One clear message, before any work, when a GPU-only benchmark script runs on a machine without a CUDA GPU."""
from __future__ import annotations

import sys

import torch


def require_gpu(script: str, cpu_hint: str = "") -> None:
    """Exit with a one-line message naming ``script`` unless torch sees a CUDA GPU; ``cpu_hint`` says what runs on a
    CPU instead, where something does."""
    if not torch.cuda.is_available():
        hint = f"; {cpu_hint}" if cpu_hint else ""
        sys.exit(f"{script}: needs a CUDA GPU, and torch sees none here{hint}")
