"""``stored_grad``: the identity, whose gradient Inductor stores once under torch.compile (``cowtune::store`` is lowered,
not run as a copy), with the same gradients as without it; and the shake-shake block's switch for it."""
from __future__ import annotations

import torch
import torch._dynamo
import torch._inductor.config as inductor
from torch._inductor.utils import run_and_get_code

from trainables.models import ShakeShakeBlock
from trainables.stored_grad import register_lowering, stored_grad


def test_eagerly_it_is_the_tensor_itself():
    x = torch.randn(3, requires_grad=True)
    assert stored_grad(x) is x
    y = torch.randn(3)
    assert stored_grad(y) is y


def residual_chain(x: torch.Tensor, ws: list[torch.Tensor], store: bool) -> torch.Tensor:
    for w in ws:
        if store:
            x = stored_grad(x)
        x = x + torch.relu(x * w).sin()
    return (x * x).sum()


def test_compiled_gradients_are_unchanged_and_the_operator_is_lowered():
    register_lowering()
    register_lowering()   # twice: a no-op
    torch.manual_seed(0)
    x = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    ws = [torch.randn(16, 16, dtype=torch.float64, requires_grad=True) for _ in range(5)]
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
    assert len(code) >= 2   # the forward's and the backward's modules
    assert not any("cowtune.store" in c for c in code)   # lowered by Inductor, not called as an operator
    for got, want in zip((t.grad for t in (x, *ws)), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_shake_shake_block_with_its_input_gradient_stored(monkeypatch):
    """A training block compiled with ``store_input_grad`` gives the eager block's output and gradients (Inductor's
    random numbers drawn as eagerly, so both draw the same shake gates)."""
    register_lowering()
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
    monkeypatch.setattr(ShakeShakeBlock, "store_input_grad", True)
    torch._dynamo.reset()
    try:
        with inductor.patch(fx_graph_cache=False, fallback_random=True):
            out_compiled, grads_compiled = run(torch.compile(block))
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(out_compiled, out_eager, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads_compiled, grads_eager):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
