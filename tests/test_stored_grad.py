"""``stored_grad``: the identity, whose gradient Inductor stores once under torch.compile (``cowtune::store`` lowered to
its input realized in the traced layout, not called as an operator), with the same gradients as without it; and the
shake-shake block's switch for it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch._inductor.config as inductor
from torch._inductor import ir, lowering
from torch._inductor.utils import run_and_get_code
from torch._inductor.virtualized import V

from trainables.fast.model_swaps import speed_up_model
from trainables.fast.stored_grad import register_lowering, stored_grad
from trainables.models.shakeshake import ShakeShakeBlock

ROOT = Path(__file__).resolve().parents[1]


def test_eagerly_it_is_the_tensor_itself():
    x = torch.randn(3, requires_grad=True)
    assert stored_grad(x) is x
    y = torch.randn(3)
    assert stored_grad(y) is y


@pytest.fixture
def lowered(monkeypatch) -> list[tuple[tuple, tuple]]:
    """The lowering registered, and spied on: (strides Inductor stores the gradient with, the traced graph's strides)
    for each ``cowtune::store`` it lowers."""
    register_lowering()
    register_lowering()   # twice: a no-op
    op = torch.ops.cowtune.store.default
    inner, seen = lowering.lowerings[op], []

    def spy(g):
        out = inner(g)
        _, layout = ir.as_storage_and_layout(out, freeze=False)   # raises unless stored
        assert isinstance(layout, ir.FixedLayout)
        seen.append((tuple(layout.stride), tuple(V.graph.current_node.args[0].meta["val"].stride())))
        return out

    monkeypatch.setitem(lowering.lowerings, op, spy)
    return seen


def test_the_registration_keys_the_compile_caches():
    """Inductor's on-disk caches are not keyed by lowerings: once the lowering is registered, torch.compile's cache-key
    tag names it, so no graph cached with the fallback's copy is loaded for it; after our operators' version, whatever
    the process imported first (a process of its own, which registers before importing the models)."""
    script = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import torch.compiler.config as compiler
from trainables.fast.stored_grad import register_lowering
register_lowering()
import trainables.models
print(compiler.cache_key_tag)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    from trainables.fast.compile_lock import operators_version
    from trainables.fast.stored_grad import CACHE_TAG

    assert r.stdout.split()[-1] == f"cowtune-operators-{operators_version()}+{CACHE_TAG}", r.stdout


def residual_chain(x: torch.Tensor, ws: list[torch.Tensor], store: bool) -> torch.Tensor:
    for w in ws:
        if store:
            x = stored_grad(x)
        x = x + torch.relu(x * w).sin()
    return (x * x).sum()


def test_compiled_gradients_are_unchanged_and_stored_in_the_traced_layout(lowered):
    torch.manual_seed(0)
    x = torch.randn(4, 6, 5, 3, dtype=torch.float64).to(memory_format=torch.channels_last).requires_grad_()
    ws = [torch.randn(4, 6, 5, 3, dtype=torch.float64).to(memory_format=torch.channels_last).requires_grad_()
          for _ in range(5)]
    residual_chain(x, ws, store=False).backward()
    expected = [t.grad.clone() for t in (x, *ws)]
    for t in (x, *ws):
        t.grad = None
    torch._dynamo.reset()
    try:
        with inductor.patch(fx_graph_cache=False):   # a cached graph would not be lowered again
            compiled = torch.compile(residual_chain)
            _, code = run_and_get_code(lambda: compiled(x, ws, True).backward())
    finally:
        torch._dynamo.reset()
    assert len(lowered) == 5   # one stored gradient a block, each in the strides the graph traced for it
    assert all(stored == traced for stored, traced in lowered) and lowered[0][1] == x.stride(), lowered
    assert not any("cowtune.store" in c for c in code)   # not called as an operator anywhere
    for got, want in zip((t.grad for t in (x, *ws)), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("store", [True, False])
def test_shake_shake_block_with_its_input_gradient_stored_or_not(monkeypatch, lowered, store):
    """A fast training block compiled with ``store_input_grad`` (the default) stores its input's gradient, and without
    it (step_ab's unstored-input-grads) stores none; either gives the eager plain block's output and gradients
    (Inductor's random numbers drawn as eagerly, so both draw the same shake gates)."""
    torch.manual_seed(0)
    block = ShakeShakeBlock(8, 16, 2).double().train()
    x = torch.randn(4, 8, 8, 8, dtype=torch.float64, requires_grad=True)

    def run(fn):
        torch.manual_seed(1)
        out = fn(x)
        out.square().sum().backward()
        grads = [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]
        x.grad = None
        block.zero_grad(set_to_none=True)
        return out.detach(), grads

    out_eager, grads_eager = run(block)
    speed_up_model(block, store_input_grad=store)
    torch._dynamo.reset()
    try:
        with inductor.patch(fx_graph_cache=False, fallback_random=True):
            out_compiled, grads_compiled = run(torch.compile(block))
    finally:
        torch._dynamo.reset()
    assert len(lowered) == int(store)
    torch.testing.assert_close(out_compiled, out_eager, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads_compiled, grads_eager):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_registered_after_inductor_made_the_operator_a_fallback():
    """A process that compiled the operator before the lowering was registered (Inductor then calls it as an
    operator, a copy no kernel fuses with) lowers it once it is registered, as an early registration does: stored in
    the traced strides. In a process of its own."""
    script = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import torch, torch._dynamo, torch._inductor.config as inductor
from torch._inductor import ir, lowering
from torch._inductor.utils import run_and_get_code
from torch._inductor.virtualized import V
from trainables.fast.stored_grad import register_lowering, stored_grad

def f(x):
    return (stored_grad(x).sin() * 2).sum()

def called():
    torch._dynamo.reset()
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last).requires_grad_()
    with inductor.patch(fx_graph_cache=False):
        _, code = run_and_get_code(lambda: torch.compile(f)(x).backward())
    return any("cowtune.store" in c for c in code)

before = called()
register_lowering()
op = torch.ops.cowtune.store.default
inner, strides = lowering.lowerings[op], []

def spy(g):
    out = inner(g)
    strides.append((tuple(ir.as_storage_and_layout(out, freeze=False)[1].stride),
                    tuple(V.graph.current_node.args[0].meta["val"].stride())))
    return out

lowering.lowerings[op] = spy
after = called()
print(before, after, len(strides) == 1 and strides[0][0] == strides[0][1], strides)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[:3] == ["True", "False", "True"], r.stdout

