"""The whole training step as one CUDA graph: losses, backward, optimiser, teacher EMA, metric sums, as
``trainables.step.train_step`` computes them (the very function is captured, with the fast kernels).

Between its compiled model passes, an eager step launches a few hundred small kernels (masks,
losses, autograd glue, optimiser, EMA, metrics); replaying one graph per step removes those launch
gaps. The graph is captured at the first step, after warm-up passes (compilation, cuDNN tuning,
optimiser state) whose effects on the weights, optimiser, batch-norm statistics and random streams
are undone, so the first real step starts from exactly the state it was given: a fresh run or a
resumed checkpoint. Per step, the batch is copied into the graph's input buffers (its images in one
copy when they lie back to back, as ``DeviceData``'s do) and the learning rate and teacher alpha into two
device scalars (one copy); nothing synchronises with the host.

The graph is captured on a high-priority stream, the teacher's and the weight gradients' streams keeping
the default priority. PyTorch instantiates graphs with per-node priorities (the stream's, at capture), so
in each replay the student's kernels, the step's critical path, get the GPU first and the side streams'
kernels fill in around them (WRN-28-2 CowMix on an H100, 2026-11-27: 195.8 steps/s against 193.9 without).

Requirements, met by ``StepRunner``: one mask generator object for the whole run (re-seeded, not
replaced, each epoch), metric sums zeroed in place, and SGD with a tensor learning rate.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from trainables.data import Batch
from trainables.fast.cuda_streams import shared_stream

WARMUP_PASSES = 3   # enough for torch.compile, cuDNN autotuning and the optimiser's momentum buffers
HIGH_PRIORITY = -1  # of the capture stream (lower is higher; the side streams have 0, the default)


Body = Callable[[Batch, torch.Generator, torch.Tensor, torch.Tensor], None]   # (batch, gen, lr, alpha): one step


class StepGraph:
    """Captures and replays a step, ``body``, of the runner ``r`` (a ``trainables.step.StepRunner``) passed to each
    call: the graph keeps no reference to either, so a dropped runner frees the graph's memory pool at once."""

    def __init__(self, device: torch.device, priority: bool = True):
        self.priority = priority   # capture on a high-priority stream (off: the default priority, for A/B timings)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: Batch | None = None
        self.images: torch.Tensor | None = None   # the inputs' images, (views, B, C, H, W)
        self.gen: torch.Generator | None = None
        self.scalars = torch.zeros(2, device=device)
        self.lr, self.alpha = self.scalars.unbind()

    def step(self, body: Body, r: Any, batch: Batch, gen: torch.Generator, lr: float, alpha: float) -> None:
        """One step: at the first call ``body`` is captured (called with the graph's input buffers and device
        scalars), then replayed with this call's batch, ``lr`` and ``alpha`` copied in."""
        if self.graph is None:
            self._capture(body, r, batch, gen)
        elif gen is not self.gen:
            raise ValueError("a captured step draws masks from the generator it was captured with: "
                             "pass runner.generator (re-seed it with manual_seed) instead of a new one")
        images = _images(batch)
        if len(images) != len(self.images):
            raise ValueError(f"a captured step takes {len(self.images)} views a batch, as at its capture; "
                             f"this batch has {len(images)}")
        block = back_to_back(images)
        if block is not None and block.shape == self.images.shape:
            self.images.copy_(block, non_blocking=True)
        else:
            for dst, src in zip(self.images, images):
                dst.copy_(src, non_blocking=True)
        self.inputs.y_sup.copy_(batch.y_sup, non_blocking=True)
        # float32 on the host rounds as a fill would; pinned, the copy is asynchronous, and PyTorch's pinned-memory
        # cache keeps the block until the copy has run
        values = torch.tensor([lr, alpha], dtype=torch.float32, pin_memory=True)
        self.scalars.copy_(values, non_blocking=True)
        self.graph.replay()

    def release(self) -> None:
        """Frees the captured graph (a later step captures again). A data-parallel worker calls it before its NCCL
        process group is destroyed: ncclCommDestroy waits forever while a graph that captured one of the group's
        collectives lives (pytorch/pytorch#115388; measured on 2 H200s: the worker hung at exit)."""
        if self.graph is not None:
            torch.cuda.synchronize()
            self.graph.reset()
            self.graph = None

    def _capture(self, body: Body, r: Any, batch: Batch, gen: torch.Generator) -> None:
        self.images = torch.stack(_images(batch))
        views = self.images.unbind()
        self.inputs = Batch(views[0], batch.y_sup.clone(), views[1], views[-1])
        saved = _snapshot(r, gen)
        side = shared_stream(r.device, "warm-up")
        side.wait_stream(torch.cuda.current_stream(r.device))
        # the body sets the optimiser's learning rate to the device scalar: fused SGD reads it, no host value baked in
        with torch.cuda.stream(side):
            for _ in range(WARMUP_PASSES):
                body(self.inputs, gen, self.lr, self.alpha)
        torch.cuda.current_stream(r.device).wait_stream(side)
        r.optimizer.zero_grad(set_to_none=True)   # backward inside the graph writes the gradients afresh
        graph = torch.cuda.CUDAGraph()
        graph.register_generator_state(gen)
        self.gen = gen
        stream = shared_stream(r.device, "capture", HIGH_PRIORITY) if self.priority else None
        # thread_local: a DataLoader's pin-memory thread may allocate while this thread captures
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            body(self.inputs, gen, self.lr, self.alpha)
        _restore(r, gen, saved)
        self.graph = graph


def _images(batch: Batch) -> list[torch.Tensor]:
    """The batch's images: labeled, unlabeled and, when ``augment_twice``, the second unlabeled view."""
    return [batch.x_sup, batch.x_unsup0] + ([] if batch.x_unsup1 is batch.x_unsup0 else [batch.x_unsup1])


def back_to_back(xs: list[torch.Tensor]) -> torch.Tensor | None:
    """``xs`` as one (len(xs), ...) view when they are contiguous tensors of one shape and dtype lying one after
    the other in one storage, else None."""
    first = xs[0]
    for a, b in zip(xs, xs[1:]):
        if not (b.shape == first.shape and b.dtype == first.dtype and b.is_contiguous() and a.is_contiguous()
                and b.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                and b.data_ptr() == a.data_ptr() + a.nbytes):
            return None
    return first.as_strided((len(xs), *first.shape), (first.numel(), *first.stride()), first.storage_offset())


def _snapshot(r: Any, gen: torch.Generator) -> dict[str, Any]:
    momentum = {p: (st["momentum_buffer"].clone() if st.get("momentum_buffer") is not None else None)
                for p, st in r.optimizer.state.items()}
    return {"student": [t.clone() for t in r.student.state_dict().values()],
            "teacher": [t.clone() for t in r.teacher.state_dict().values()],
            "momentum": momentum, "gen": gen.get_state(), "cuda_rng": torch.cuda.get_rng_state(r.device)}


@torch.no_grad()
def _restore(r: Any, gen: torch.Generator, saved: dict[str, Any]) -> None:
    """Undo the warm-up in place (the graph holds these very tensors)."""
    for model, key in ((r.student, "student"), (r.teacher, "teacher")):
        for t, v in zip(model.state_dict().values(), saved[key]):
            t.copy_(v)
    for p, st in r.optimizer.state.items():
        buf, before = st.get("momentum_buffer"), saved["momentum"].get(p)
        if buf is not None:   # a zero buffer makes SGD's next update m * 0 + grad = grad, as on its first step
            buf.copy_(before) if before is not None else buf.zero_()
    gen.set_state(saved["gen"])
    torch.cuda.set_rng_state(saved["cuda_rng"], r.device)
    for v in r.sums.values():
        v.zero_()
