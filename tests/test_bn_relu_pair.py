"""trainables.fast.bn_relu_pair: both inner batch norms + ReLUs of a shake-shake block as one function.

The backward kernels run on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1 around the module's import, as in
test_conv_rows), against the PyTorch formula; the function and the switched block against separate batch norms and
ReLUs in float64 (the PyTorch formula, which runs where the kernels do not).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, import_for_triton

from trainables.fast.model_swaps import speed_up_model
from trainables.models.shakeshake import ShakeShakeBlock
from trainables.models.segmented_bn import (SegmentedBatchNorm2d, batch_segments, convert_batch_norm,
                                            pairs_in_one_pass, segmentable)

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot run")


def _import_as(interpreted: bool):
    return import_for_triton("trainables.fast.bn_relu_pair", interpreted)


def _import_interpreted():
    return _import_as(interpreted=True)


def _cl(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


def _case(n, c, h, w, segments, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = _cl(torch.randn(n, 2 * c, h, w, generator=g) * 2 + 0.5).to(dtype)
    dha, dhb = (_cl(torch.randn(n, c, h, w, generator=g)).to(dtype) for _ in range(2))
    ys = y.float().unflatten(0, (segments, -1))
    var, mean = torch.var_mean(ys, dim=(1, 3, 4), correction=0)
    weight = torch.randn(2 * c, generator=g)   # some negative: the mask must follow the scale's sign
    bias = torch.randn(2 * c, generator=g)
    return dha, dhb, y, mean, var, weight, bias


# (N, C, H, W, segments): a segment of 128 pixels in one chunk, one 32-channel block per branch; a segment of 24 pixels
# in three chunks of 8 (the largest power of two dividing 24), three 8-channel blocks per branch; one segment
CASES = [(4, 32, 8, 8, 2), (4, 24, 2, 6, 2), (3, 16, 4, 4, 1)]


@pytest.mark.parametrize("n, c, h, w, segments", CASES)
def test_kernels_give_the_formulas_gradients(n, c, h, w, segments):
    brp = _import_interpreted()
    args = _case(n, c, h, w, segments)
    assert brp.kernels_run(args[2])
    dy, dw, db = brp.bn_relu_pair_backward(*args, 1e-5, segments)
    ref = brp._reference_backward(*[a.double() for a in args], 1e-5, segments)
    assert dy.dtype == torch.float32 and dy.is_contiguous(memory_format=torch.channels_last)
    assert dw.dtype == db.dtype == torch.float32
    for got, want in zip((dy, dw, db), ref):
        assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4), (got.double() - want).abs().max()


def test_op_takes_any_layout():
    """The kernels index y and the output gradients as channels_last; given them in NCHW order, the op copies the
    gradients and leaves y to the PyTorch formula, and its result is the same."""
    brp = _import_interpreted()
    args = _case(4, 32, 8, 8, 2)
    nchw = [t.contiguous() for t in args[:3]]
    assert not nchw[2].is_contiguous(memory_format=torch.channels_last) and not brp.kernels_run(nchw[2])
    want = brp._reference_backward(*[a.double() for a in args], 1e-5, 2)
    before = brp.KERNEL_CALLS
    for ins in (nchw, [nchw[0], nchw[1], args[2]]):
        got = brp.bn_relu_pair_backward(*ins, *args[3:], 1e-5, 2)
        assert got[0].is_contiguous(memory_format=torch.channels_last)
        for a, b in zip(got, want):
            assert torch.allclose(a.double(), b, rtol=1e-4, atol=1e-4), (a.double() - b).abs().max()
    assert brp.KERNEL_CALLS == before + 1   # the NCHW y by the formula, the channels_last one by the kernels


def test_kernels_add_many_chunks_in_tiles(monkeypatch):
    """A segment of 128 chunks of 16 pixels: the coefficient kernel adds them in two tiles of 64."""
    brp = _import_interpreted()
    for name, value in (("BLOCK_PIXELS", 8), ("CHUNK_PIXELS", 16), ("MIN_PROGRAMS", 0)):
        monkeypatch.setattr(brp, name, value)
    args = _case(4, 8, 32, 32, 2)
    assert brp.launch_plan(*args[2].shape, 2) == (16, 8, 8)
    got = brp.bn_relu_pair_backward(*args, 1e-5, 2)
    want = brp._reference_backward(*[a.double() for a in args], 1e-5, 2)
    for g, w in zip(got, want):
        assert torch.allclose(g.double(), w, rtol=1e-4, atol=1e-4), (g.double() - w).abs().max()


def test_kernels_in_bfloat16_are_near_float64():
    brp = _import_interpreted()
    args = _case(4, 16, 4, 8, 2, dtype=torch.bfloat16)
    dy, dw, db = brp.bn_relu_pair_backward(*args, 1e-5, 2)
    ref_dy, ref_dw, ref_db = brp._reference_backward(*[a.double() for a in args], 1e-5, 2)
    assert dy.dtype == torch.bfloat16
    assert (dy.double() - ref_dy).abs().max() <= 0.01 * ref_dy.abs().max()
    assert torch.allclose(dw.double(), ref_dw, rtol=1e-4, atol=1e-3)
    assert torch.allclose(db.double(), ref_db, rtol=1e-4, atol=1e-3)


def _separate(y, weight, bias, segments, eps):
    """relu(batch norm) of each half of y, each run of rows with its own statistics, as separate F.batch_norm calls."""
    c = y.shape[1] // 2
    halves = []
    for half, w, b in ((y[:, :c], weight[:c], bias[:c]), (y[:, c:], weight[c:], bias[c:])):
        halves.append(torch.cat([F.relu(F.batch_norm(part, None, None, w, b, True, 0.0, eps))
                                 for part in half.chunk(segments)]))
    return halves


def test_function_gives_separate_batch_norms_outputs_and_gradients():
    """Float64 on the CPU (the PyTorch formula): outputs, statistics, and the gradients of the input, weights and
    biases, against two batch norms and ReLUs per segment."""
    from trainables.fast.bn_relu_pair import bn_relu_pair

    g = torch.Generator().manual_seed(1)
    y = _cl(torch.randn(6, 16, 5, 5, generator=g, dtype=torch.float64)).requires_grad_()
    weight = torch.randn(16, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(16, generator=g, dtype=torch.float64, requires_grad=True)
    ha, hb, mean_a, var_a, mean_b, var_b = bn_relu_pair(y, weight[:8], bias[:8], weight[8:], bias[8:], 3, 1e-5)
    mean, var = torch.cat([mean_a, mean_b], dim=1), torch.cat([var_a, var_b], dim=1)
    y2, w2, b2 = (t.detach().clone().requires_grad_() for t in (y, weight, bias))
    ra, rb = _separate(y2, w2, b2, 3, 1e-5)
    assert torch.allclose(ha, ra, atol=1e-12) and torch.allclose(hb, rb, atol=1e-12)
    assert ha.is_contiguous(memory_format=torch.channels_last)
    parts = y.detach().unflatten(0, (3, -1))
    assert torch.allclose(mean, parts.mean((1, 3, 4)), atol=1e-12)
    assert torch.allclose(var, parts.var((1, 3, 4), correction=0), atol=1e-12)
    wa, wb = torch.randn(ha.shape, generator=g, dtype=torch.float64), torch.randn(hb.shape, generator=g,
                                                                                  dtype=torch.float64)
    ((ha * wa).sum() + (hb * wb).sum()).backward()
    ((ra * wa).sum() + (rb * wb).sum()).backward()
    for got, want in ((y.grad, y2.grad), (weight.grad, w2.grad), (bias.grad, b2.grad)):
        assert torch.allclose(got, want, atol=1e-10), (got - want).abs().max()


def _block_pair(monkeypatch):
    monkeypatch.setattr(SegmentedBatchNorm2d, "one_pass_eager", True)
    torch.manual_seed(0)
    block = convert_batch_norm(ShakeShakeBlock(8, 8, 1)).double()
    for bn in segmentable(block):
        with torch.no_grad():
            bn.weight.uniform_(-1, 2)
            bn.bias.uniform_(-1, 1)
    return block, copy.deepcopy(block)


def test_switched_block_is_the_block(monkeypatch):
    """A shake-shake block with the switch on gives the outputs, parameter gradients, input gradient and running
    statistics of the block with it off (float64, the one-pass path run eagerly, the same shake gates), and runs the
    paired function once."""
    plain, paired = _block_pair(monkeypatch)
    calls = []
    pair_of = _import_interpreted().bn_relu_pair_of
    monkeypatch.setattr("trainables.fast.model_swaps.bn_relu_pair_of", lambda *a: calls.append(1) or pair_of(*a))
    x = torch.randn(8, 8, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    x = _cl(x)
    outs, inputs = {}, {}
    for on, block in ((False, plain), (True, paired)):
        speed_up_model(block, paired_inner_bn_relu=on)
        inputs[on] = x.clone().requires_grad_()
        torch.manual_seed(3)   # the shake gates
        with batch_segments(segmentable(block), ((4, True), (4, False))):
            outs[on] = block(inputs[on])
        (outs[on] * torch.linspace(-1, 1, outs[on].numel(), dtype=torch.float64).view_as(outs[on])).sum().backward()
    assert calls == [1]
    assert torch.allclose(outs[False], outs[True], atol=1e-12)
    assert torch.allclose(inputs[False].grad, inputs[True].grad, atol=1e-10)
    grads = dict(paired.named_parameters())
    for name, p in plain.named_parameters():
        assert torch.allclose(p.grad, grads[name].grad, atol=1e-10), name
    states = paired.state_dict()
    for name, v in plain.state_dict().items():
        assert torch.allclose(v.double(), states[name].double(), atol=1e-12), name


def test_pair_only_on_the_one_pass_path(monkeypatch):
    block, _ = _block_pair(monkeypatch)
    bn_a, bn_b = block.branch_a[2], block.branch_b[2]
    y = torch.randn(8, 16, 4, 4, dtype=torch.float64)
    assert not pairs_in_one_pass(bn_a, bn_b, y)   # no segments
    with batch_segments(segmentable(block), ((4, True), (4, False))):
        assert pairs_in_one_pass(bn_a, bn_b, y)
        assert not pairs_in_one_pass(bn_a, bn_b, y[:6])   # segments that do not cover the batch
        assert not pairs_in_one_pass(bn_a, bn_b, y[:, :12])   # not both layers' channels
        monkeypatch.setattr(SegmentedBatchNorm2d, "one_pass_eager", False)
        assert not pairs_in_one_pass(bn_a, bn_b, y)   # eager: the split path


def test_compiled_switched_block_is_the_eager_block(monkeypatch):
    """Under torch.compile (where the one-pass path runs, and the backward calls ``cowtune::bn_relu_pair_backward``
    through its fake implementation while tracing), the switched block gives the eager unswitched block's outputs and
    gradients, float32 on the CPU, with the compiled backward running the kernels (in the interpreter)."""
    from torch._inductor import config as inductor_config

    brp = _import_interpreted()
    calls_before = brp.KERNEL_CALLS

    torch.manual_seed(0)
    plain = convert_batch_norm(ShakeShakeBlock(8, 8, 1))
    paired = copy.deepcopy(plain)
    x = _cl(torch.randn(8, 8, 6, 6, generator=torch.Generator().manual_seed(2)))
    w = torch.randn(8, 8, 6, 6, generator=torch.Generator().manual_seed(4))
    calls, pair_of = [], brp.bn_relu_pair_of
    monkeypatch.setattr("trainables.fast.model_swaps.bn_relu_pair_of", lambda *a: calls.append(1) or pair_of(*a))
    results = {}
    for on, block in ((False, plain), (True, paired)):
        speed_up_model(block, paired_inner_bn_relu=on)
        xi = x.clone().requires_grad_()

        def run(t, block=block):
            with batch_segments(segmentable(block), ((4, True), (4, False))):
                return block(t)

        fn = torch.compile(run) if on else run
        torch.manual_seed(3)   # the shake gates: drawn by PyTorch's generator in both (fallback_random)
        with inductor_config.patch(fallback_random=True):
            out = fn(xi)
        (out * w).sum().backward()
        results[on] = (out.detach(), xi.grad, {n: p.grad for n, p in block.named_parameters()})
    assert calls == [1]   # traced once, on the one-pass path
    assert brp.KERNEL_CALLS == calls_before + 1   # its backward ran the kernels
    out0, gx0, gp0 = results[False]
    out1, gx1, gp1 = results[True]
    assert torch.allclose(out0, out1, atol=1e-4), (out0 - out1).abs().max()
    assert torch.allclose(gx0, gx1, atol=1e-4), (gx0 - gx1).abs().max()
    for name, g in gp0.items():
        assert torch.allclose(g, gp1[name], atol=1e-3, rtol=1e-4), name


def test_gpu_check_of_the_kernels_runs_in_the_interpreter(monkeypatch, capsys):
    """benchmarks/gpu_checks.py bn_relu_pair, at 4 images on the CPU: the kernels ran and passed at each shape."""
    brp = _import_interpreted()
    monkeypatch.setattr(brp, "MIN_PROGRAMS", 1)   # the largest chunks: fewer programs for the interpreter
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_checks

    assert gpu_checks.check_bn_relu_pair(where="cpu", images=4)
    out = capsys.readouterr().out
    assert out.count("kernels True") == 3 and out.count(": OK") == 3, out


def test_kernels_compile_for_an_h100():
    """The three kernels compile to an sm_90 binary with Triton's own compiler and ptxas (no GPU needed): the
    interpreter runs code the compiler may refuse. Their loads of the activations are 16-byte vectors, given the
    16-byte-aligned pointers that a launch sees."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    brp = _import_as(interpreted=False)
    assert not brp.INTERPRET
    acts = {name: "*bf16" for name in ("dha", "dhb", "y")}
    stats = {name: "*fp32" for name in ("mean_p", "var_p", "w_p", "b_p")}
    kernels = [
        (brp._sums_kernel, {**acts, **stats, "part": "*fp32", "eps": "fp32", "PSEG": "i32", "CHUNK": "i32"},
         {"C2": 192, "CH": 96, "BP": 128, "BC": 32}),
        (brp._coef_kernel, {"part": "*fp32", **stats, "coef": "*fp32", "dw": "*fp32", "db": "*fp32", "eps": "fp32",
                            "inv_m": "fp32", "S": "i32", "CHUNKS": "i32"}, {"C2": 192, "BC": 32, "BK": 64}),
        (brp._apply_kernel, {**acts, **stats, "coef": "*fp32", "dy": "*bf16", "eps": "fp32", "PSEG": "i32"},
         {"C2": 192, "CH": 96, "BP": 128, "BC": 32}),
    ]
    for fn, signature, constexprs in kernels:
        signature = {**signature, **{name: "constexpr" for name in constexprs}}
        attrs = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind.startswith("*")}
        binary = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert binary.asm["cubin"], fn.__name__
        if fn is not brp._coef_kernel:
            loads = re.findall(r"ld\.global[.\w]*", binary.asm["ptx"])
            assert "ld.global.v4.b32" in loads and "ld.global.b16" not in loads, (fn.__name__, set(loads))
