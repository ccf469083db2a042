"""``stored_grad(x)``: ``x`` itself, whose gradient Inductor stores once instead of recomputing it where it is read.

Inductor does not store a pointwise result that several kernels read while it reads few enough buffers
(``realize_reads_threshold``); each reader recomputes it from its inputs. Down a residual chain the gradient at a
block's input is the gradient at its output plus its branches' contribution, so it grows by a few reads a block,
and every kernel of the blocks below reads all the partial gradients again until the count passes the threshold.
A lower threshold stores the chain's gradient more often, and everything else that several kernels read as well.

``stored_grad`` marks one tensor: under torch.compile its backward passes the gradient through the operator
``cowtune::store``, whose Inductor lowering realizes its input (one store, in the layout the traced graph gives it)
and hands that buffer on. Everything else is fused as before. The lowering is registered by ``register_lowering``
(the trainer calls it before compiling); without it Inductor calls the operator as a copy that no kernel fuses
with, as it runs eagerly, so ``stored_grad`` applies it only while compiling.

Used by the fast shake-shake blocks (``trainables.fast.model_swaps``) while their ``store_input_grad`` is on (the
default: +2.2% in an untuned A/B run of the WRN-26 shake-shake step on an H100; docs/journal/2026-11-27.md).
"""
from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("cowtune::store", mutates_args=())
def _store(g: Tensor) -> Tensor:
    return g.clone()


@_store.register_fake
def _(g: Tensor) -> Tensor:
    return torch.empty_like(g)


_LOWERED = False
CACHE_TAG = "cowtune-store-lowered"


def register_lowering() -> None:
    """Register Inductor's lowering of ``cowtune::store``: its input realized, in the stride order the traced graph
    gives it, and handed on as it is (no copy). Without it Inductor calls the operator as an external kernel, a copy
    that no kernel fuses with. Called by the trainer before it compiles (not here at import: Inductor's lowering
    module is a heavy import for a process that never compiles). If Inductor met the operator before, it made it a
    fallback; that registration is undone. Registering twice is a no-op.

    The operator's schema promises a fresh tensor, and the lowering hands on its input's buffer: safe because its
    one caller, ``_StoredGrad``'s backward, is the only reader of that input. The traced stride order is the
    eager graph's (channels_last for the trainer's activations on CUDA), which may differ from one Inductor's layout
    optimisation would pick for a contiguous model.

    Inductor's and AOTAutograd's on-disk caches are not keyed by lowerings: a graph compiled before the registration
    (with the fallback's copy) would be loaded by a process compiling the same graph after it. So the registration
    also adds ``CACHE_TAG`` to torch.compile's cache-key tag, after our operators' version (``tag_compile_caches``),
    so that every process spells the tag alike whatever it imported first."""
    global _LOWERED
    if _LOWERED:
        return
    from trainables.fast.compile_lock import tag_compile_caches

    tag_compile_caches(CACHE_TAG)
    from torch._inductor import ir, lowering
    from torch._inductor.virtualized import V

    op = torch.ops.cowtune.store.default
    # what making it a fallback registered, so that a late registration lowers as an early one does
    lowering.fallbacks.discard(op)
    lowering.needs_realized_inputs.discard(op)
    getattr(lowering, "_maybe_layout_constraints", {}).pop(op, None)
    lowering.lowerings.pop(op, None)

    @lowering.register_lowering(op, type_promotion_kind=None)
    def _lower(g):
        g.realize()
        strides = V.graph.current_node.args[0].meta["val"].stride()
        return ir.ExternKernel.require_stride_order(g, ir.get_stride_order(strides, V.graph.sizevars.shape_env))

    _LOWERED = True


class _StoredGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        return torch.ops.cowtune.store(g)


def stored_grad(x: Tensor) -> Tensor:
    """``x``; under torch.compile, with its gradient stored once by Inductor (the module docstring)."""
    if not (torch.compiler.is_compiling() and x.requires_grad):
        return x
    return _StoredGrad.apply(x)
