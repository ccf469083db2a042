"""Memory a dropped runner leaves behind, as a reused trial worker meets it (one runner per trial, one process).

Builds ``--runners`` WRN-28-2 CowMix runners one after the other on the GPU, steps each a few times on
synthetic CIFAR-sized images, drops it, and prints the memory the caching allocator still counts as
allocated, and whether the runner, its student and its optimiser were freed:

    python benchmarks/runner_memory.py --runners 4
    python benchmarks/runner_memory.py --runners 4 --cuda-graph none

Growth from one runner to the next is memory a long search would pile up in each worker.
"""
from __future__ import annotations

import argparse
import gc
import sys
import weakref
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_required import require_gpu  # noqa: E402
from throughput import load_images, make_config  # noqa: E402

from trainables.data import DeviceData, make_splits  # noqa: E402
from trainables.trainer import autotune_convolutions, build_runner  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runners", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--model", default="wrn28_2")
    p.add_argument("--method", default="cowmix")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--cuda-graph", default="step", choices=("step", "model", "none"))
    args = p.parse_args(argv)
    require_gpu("runner_memory.py")   # it reads the CUDA caching allocator's counts
    autotune_convolutions()
    device = torch.device("cuda")
    raw = load_images(None, 20000)
    data = DeviceData(raw, make_splits(raw.train_labels, 0, 131, 1000, 0, raw.fingerprint), True, 4, device)
    base = torch.cuda.memory_allocated(device)
    print(f"# runner memory on {torch.cuda.get_device_name(device)}, torch {torch.__version__}, {args.model} "
          f"{args.method}, cuda_graph {args.cuda_graph}; the data on the GPU: {base / 2**20:.0f} MiB", flush=True)
    for i in range(args.runners):
        cfg = make_config(args.model, args.method, args.batch, "cuda", True, True, cuda_graph=args.cuda_graph,
                          tune_kernels=False)
        runner = build_runner(cfg, len(raw.class_names), device)
        gen = runner.generator.manual_seed(i)
        for batch in data.train_batches(i, 0, args.batch, args.steps, False):
            runner.step(batch, gen, 0.05, 0.97)
        del batch   # a view of its chunk of augmented batches
        runner.read_metrics()
        torch.cuda.synchronize(device)
        live = torch.cuda.memory_allocated(device) - base
        alive = {name: weakref.ref(obj) for name, obj in
                 (("runner", runner), ("student", runner.student), ("optimizer", runner.optimizer))}
        del runner, gen
        gc.collect()
        torch.cuda.empty_cache()
        left = torch.cuda.memory_allocated(device) - base
        still = [name for name, ref in alive.items() if ref() is not None]
        print(f"runner {i}: {live / 2**20:.0f} MiB allocated while it lived, {left / 2**20:.0f} MiB after it was "
              f"dropped; reserved {torch.cuda.memory_reserved(device) / 2**20:.0f} MiB; "
              f"{'still alive: ' + ', '.join(still) if still else 'all freed'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
