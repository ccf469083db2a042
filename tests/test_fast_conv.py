"""The ``cowtune::conv3x3`` operator and the model switch to it (``trainables.fast.fast_conv``), on CPU:
its registrations (fake, autograd) agree with the real kernels, a switched model computes what the
original does, forward and backward, eagerly and under torch.compile."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainables.fast.fast_conv import TritonConv2d, apply_conv_kernels, computes_on_rows, eligible, use_triton_convs
from trainables.models import create_model
from trainables.models.layers import BnFedConv2d, SameConv2d


@pytest.mark.parametrize("channels_last", [False, True])
def test_operator_registrations_agree(channels_last):
    x = torch.randn(1, 16, 4, 3, dtype=torch.float64, requires_grad=True)
    if channels_last:
        x = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    w = torch.randn(16, 16, 3, 3, dtype=torch.float64, requires_grad=True)
    if channels_last:   # as ``model.to(memory_format=torch.channels_last)`` leaves a convolution's weight
        w = w.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    torch.library.opcheck(torch.ops.cowtune.conv3x3.default, (x, w, w))
    dy = torch.randn(1, 16, 4, 3, dtype=torch.float64)
    for input_grad in (True, False):   # False: a first layer's, whose input needs no gradient
        torch.library.opcheck(torch.ops.cowtune.conv3x3_backward.default, (dy, x.detach(), w.detach(), w.detach(),
                                                                           input_grad))
    assert torch.autograd.gradcheck(lambda a, b: torch.ops.cowtune.conv3x3(a, b, b), (x, w))


def test_switch_only_eligible_layers_and_keep_the_state_dict():
    torch.manual_seed(0)
    model = create_model("wrn28_2", 10)
    keys = list(model.state_dict())
    # WRN-28-2: 25 3x3 convolutions; the two stride-2 ones stay cuDNN's (the stem, on 3 channels, is switched)
    assert use_triton_convs(model) == 23
    assert list(model.state_dict()) == keys
    assert sorted((m.in_channels, m.kernel_size, m.stride) for m in model.modules() if type(m) is nn.Conv2d) == [
        (16, (1, 1), (1, 1)), (32, (1, 1), (2, 2)), (32, (3, 3), (2, 2)),
        (64, (1, 1), (2, 2)), (64, (3, 3), (2, 2))]
    assert not eligible(nn.Conv2d(48, 32, 3, 1, 1, bias=False))
    assert not eligible(nn.Conv2d(32, 24, 3, 1, 1, bias=False)) and not eligible(nn.Conv2d(32, 32, 3, 2, 1, bias=False))
    assert eligible(nn.Conv2d(16, 32, 3, 1, 1, bias=False)) and eligible(nn.Conv2d(3, 16, 3, 1, 1, bias=False))
    assert not eligible(nn.Conv2d(3, 8, 3, 1, 1, bias=False))


def test_setting_switches_only_on_the_gpus_the_table_was_measured_on(monkeypatch):
    """The GPU's compute capability is read through torch.cuda (there is no GPU here to read it from)."""
    model = create_model("wrn28_2", 10)
    cuda = torch.device("cuda")   # a device, not a tensor on it
    assert apply_conv_kernels(model, "triton", "step", torch.device("cpu")) == 0   # off the GPU: PyTorch's own
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert apply_conv_kernels(model, "triton", "step", cuda) == 0   # untuned GPU: cuDNN throughout
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert apply_conv_kernels(model, "cudnn", "step", cuda) == 0
    for graphs in ("model", "none"):   # launched one by one, Triton's launcher costs more than they save
        assert apply_conv_kernels(model, "triton", graphs, cuda) == 0
    assert not any(type(m) is TritonConv2d for m in model.modules())
    assert apply_conv_kernels(model, "triton", "step", cuda) == 23
    assert sum(type(m) is TritonConv2d for m in model.modules()) == 23
    shake = create_model("wrn26_6_shakeshake", 10)   # its stem has a bias, its first block's layers are SameConv2d
    assert apply_conv_kernels(shake, "triton", "step", cuda, same_and_biased=False) == 0
    assert apply_conv_kernels(shake, "triton", "step", cuda) == 4


def test_switched_model_computes_the_same_forward_and_backward():
    torch.manual_seed(0)
    a = create_model("wrn28_2", 10)
    b = copy.deepcopy(a)
    use_triton_convs(b)
    x = torch.randn(4, 3, 32, 32)
    ya, yb = a(x), b(x)
    torch.testing.assert_close(yb, ya, rtol=0, atol=0)
    ya.square().sum().backward()
    yb.square().sum().backward()
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)


def test_switched_model_under_autocast_matches_and_keeps_float32_gradients():
    """Under autocast the operator sees the bf16 input autocast would give a convolution and casts the weight
    itself: the same bf16 outputs as the original model, and gradients in the parameters' float32."""
    torch.manual_seed(0)
    a = create_model("wrn28_2", 10)
    b = copy.deepcopy(a)
    use_triton_convs(b)
    x = torch.randn(2, 3, 32, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya, yb = a(x), b(x)
    assert yb.dtype == ya.dtype == torch.bfloat16
    torch.testing.assert_close(yb, ya, rtol=0, atol=0)
    ya.float().square().sum().backward()
    yb.float().square().sum().backward()
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert q.grad.dtype == torch.float32, name
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)


def test_compiled_switched_layers_match_eager():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(32, 64, 3, 1, 1, bias=False), nn.ReLU(), nn.Conv2d(64, 32, 3, 1, 1, bias=False))
    ref = copy.deepcopy(net)
    assert use_triton_convs(net) == 2 and all(type(m) is TritonConv2d for m in (net[0], net[2]))
    x = torch.randn(3, 32, 8, 8).contiguous(memory_format=torch.channels_last)
    out = torch.compile(net, dynamic=False)(x)
    expect = ref(x)
    torch.testing.assert_close(out, expect)
    out.sum().backward()
    expect.sum().backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_cuda_kernels_of_the_operators_in_the_interpreter(monkeypatch):
    """The operators' CUDA implementations (the row kernels where the table has the shape, cuDNN's path where
    it has not, plus layout and dtype handling), called on CPU tensors with the kernels in Triton's
    interpreter, against PyTorch's convolution."""
    pytest.importorskip("triton")
    import importlib
    import sys

    from trainables.fast import fast_conv

    before = sys.modules.get("trainables.fast.conv_rows")
    was_interpreted = getattr(before, "INTERPRET", None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")   # read when conv_rows' kernels are defined
    module = importlib.reload(before) if before is not None else importlib.import_module("trainables.fast.conv_rows")
    monkeypatch.delenv("TRITON_INTERPRET")
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, 32, 4, 8, generator=g).contiguous(memory_format=torch.channels_last)
        w = (torch.randn(32, 32, 3, 3, generator=g) / 17).contiguous(memory_format=torch.channels_last)
        dy = torch.randn(2, 32, 4, 8, generator=g)
        expect_y = F.conv2d(x, w, padding=1)
        expect_dx, expect_dw, _ = torch.ops.aten.convolution_backward(dy, x, w, None, [1, 1], [1, 1], [1, 1], False,
                                                                      [0, 0], 1, [True, True, False])
        for table in ({}, {(op, 0, 32, 32, 4, 8): {"BM": 16, "SEGS": 2} for op in ("fprop", "dgrad", "wgrad")},
                      {("wgrad", 2, 32, 32, 4, 8): {"BM": 16}}):
            monkeypatch.setattr(module, "CONFIGS", table)
            y = fast_conv._conv3x3_cuda(x, w, w)
            assert y.is_contiguous(memory_format=torch.channels_last)
            torch.testing.assert_close(y, expect_y, rtol=1e-4, atol=1e-4)
            dx, dw = fast_conv._conv3x3_backward_cuda(dy, x, w, w, True)
            torch.testing.assert_close(dx, expect_dx, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(dw, expect_dw, rtol=1e-4, atol=1e-4)
            assert dw.dtype == w.dtype and dw.stride() == w.stride()
            dx, dw = fast_conv._conv3x3_backward_cuda(dy, x, w, w, False)   # a first layer's: no input gradient
            assert dx.numel() == 0
            torch.testing.assert_close(dw, expect_dw, rtol=1e-4, atol=1e-4)
        # a stem on the images' 3 channels, with the row kernels' entries: its forward and weight gradient, no dx
        x3 = torch.randn(2, 3, 4, 8, generator=g).contiguous(memory_format=torch.channels_last)
        w3 = (torch.randn(16, 3, 3, 3, generator=g) / 5).contiguous(memory_format=torch.channels_last)
        dy3 = torch.randn(2, 16, 4, 8, generator=g)
        monkeypatch.setattr(module, "CONFIGS", {(op, 0, 3, 16, 4, 8): {"BM": 16, "SEGS": 2} for op in ("fprop", "wgrad")})
        torch.testing.assert_close(fast_conv._conv3x3_cuda(x3, w3, w3), F.conv2d(x3, w3, padding=1), rtol=1e-4, atol=1e-4)
        dx, dw = fast_conv._conv3x3_backward_cuda(dy3, x3, w3, w3, False)
        expect_dw3 = torch.ops.aten.convolution_backward(dy3, x3, w3, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                                         [False, True, False])[1]
        assert dx.numel() == 0 and dw.stride() == w3.stride()
        torch.testing.assert_close(dw, expect_dw3, rtol=1e-4, atol=1e-4)
        # the shake-shake WRN-26's 16 -> 96 shape: output-channel tiles of 32 (three of them), its input gradient on
        # the cuDNN path (the table has no entry for it)
        x16 = torch.randn(2, 16, 4, 8, generator=g).contiguous(memory_format=torch.channels_last)
        w16 = (torch.randn(96, 16, 3, 3, generator=g) / 12).contiguous(memory_format=torch.channels_last)
        dy16 = torch.randn(2, 96, 4, 8, generator=g)
        monkeypatch.setattr(module, "CONFIGS", {(op, 0, 16, 96, 4, 8): {"BM": 16, "BN": 32} for op in ("fprop", "wgrad")})
        torch.testing.assert_close(fast_conv._conv3x3_cuda(x16, w16, w16), F.conv2d(x16, w16, padding=1),
                                   rtol=1e-4, atol=1e-4)
        dx, dw = fast_conv._conv3x3_backward_cuda(dy16, x16, w16, w16, True)
        expect_dx16, expect_dw16, _ = torch.ops.aten.convolution_backward(dy16, x16, w16, None, [1, 1], [1, 1], [1, 1],
                                                                          False, [0, 0], 1, [True, True, False])
        torch.testing.assert_close(dx, expect_dx16, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(dw, expect_dw16, rtol=1e-4, atol=1e-4)
    finally:   # leave the module as this test found it: compiled kernels stay compiled for later tests
        if before is None:
            del sys.modules["trainables.fast.conv_rows"]
        elif not was_interpreted:
            importlib.reload(module)


def test_a_kernel_the_gpu_cannot_run_falls_back_to_cudnn_once(monkeypatch):
    """A row kernel that runs out of shared memory on some GPU warns once and leaves that op and shape to
    cuDNN's path for the rest of the process (the kernel is made to raise Triton's own error here)."""
    pytest.importorskip("triton")
    from triton.runtime.errors import OutOfResources

    from trainables.fast import conv_rows, fast_conv

    calls = []

    def too_big(*args, **kwargs):
        calls.append(1)
        raise OutOfResources(300000, 232448, "shared memory")

    monkeypatch.setattr(conv_rows, "CONFIGS", {("fprop", 0, 32, 32, 4, 8): {"BM": 16}})
    monkeypatch.setattr(conv_rows, "conv3x3_rows_fwd", too_big)
    monkeypatch.setattr(fast_conv, "_FELL_BACK", set())
    x = torch.randn(2, 32, 4, 8).contiguous(memory_format=torch.channels_last)
    w = torch.randn(32, 32, 3, 3) / 17
    with pytest.warns(RuntimeWarning, match="cannot run here"):
        y = fast_conv._conv3x3_cuda(x, w, w)
    torch.testing.assert_close(y, F.conv2d(x, w, padding=1))
    fast_conv._conv3x3_cuda(x, w, w)   # remembered: not tried again
    assert len(calls) == 1 and fast_conv._FELL_BACK == {("fprop", 2, 32, 32, 4, 8)}


def test_switch_takes_biased_and_same_padded_layers():
    """WRN-28-2's 23 layers; the shake-shake WRN-26's stem (with a bias) and its first block's three 16 -> 96
    convolutions (``SameConv2d`` at stride 1), which keep their own methods; narrowed (``same_and_biased`` false, for
    A/B timings), neither, and the setting is the caller's: the next call with the default takes them again."""
    assert use_triton_convs(create_model("wrn28_2", 10)) == 23
    model = create_model("wrn26_6_shakeshake", 10)
    keys = list(model.state_dict())
    assert use_triton_convs(model) == 4
    assert list(model.state_dict()) == keys
    block = model.blocks[0]
    switched = [model.stem, block.branch_a[1], block.branch_b[1], block.shortcut[0]]
    assert all(isinstance(m, TritonConv2d) for m in switched)
    assert isinstance(block.shortcut[0], BnFedConv2d) and isinstance(model.stem, SameConv2d)
    assert model.stem.bias is not None and sum(isinstance(m, TritonConv2d) for m in model.modules()) == 4
    assert eligible(nn.Conv2d(32, 32, 3, 1, 1, bias=True))
    assert not eligible(SameConv2d(16, 32, 3, 2)) and not eligible(model.stem)   # stride 2; switched already
    assert not computes_on_rows(model.stem, torch.randn(2, 3, 32, 32))   # a CPU input: PyTorch's convolution
    assert not computes_on_rows(SameConv2d(16, 32, 3), torch.randn(2, 16, 32, 32))   # not switched

    class OwnForward(SameConv2d):   # a subclass with a forward of its own: not replaced
        def forward(self, x):
            return super().forward(x) * 2

    assert not eligible(OwnForward(16, 32, 3))
    assert use_triton_convs(create_model("wrn26_6_shakeshake", 10), same_and_biased=False) == 0
    biased, same = nn.Conv2d(32, 32, 3, 1, 1, bias=True), SameConv2d(16, 32, 3)
    assert not eligible(biased, same_and_biased=False) and not eligible(same, same_and_biased=False)
    assert eligible(nn.Conv2d(32, 32, 3, 1, 1, bias=False), same_and_biased=False)   # nn.Conv2d without bias: both ways
    assert eligible(biased) and eligible(same) and eligible(biased, same_and_biased=True)
    assert use_triton_convs(create_model("wrn26_6_shakeshake", 10)) == 4
    assert use_triton_convs(create_model("wrn28_2", 10), same_and_biased=False) == 23   # its layers have no bias


@pytest.mark.parametrize("train, folded, rows", [(True, False, False), (True, False, True), (False, True, False),
                                                 (False, False, True)],
                         ids=["train-stacked", "train-one-by-one", "eval-folded", "eval-unfolded-one-by-one"])
def test_switched_shakeshake_computes_the_same(train, folded, rows, monkeypatch):
    """The shake-shake WRN-26 switched against the unswitched model, float64, forward (and backward in training);
    ``rows``: the first block's first convolutions one by one, as where the row kernels compute them (on a GPU; here
    the operator runs PyTorch's convolution); ``folded``: eval mode's batch norms folded (stacked there always)."""
    from trainables.fast import model_swaps

    monkeypatch.setattr(model_swaps, "computes_on_rows", lambda conv, x: rows and isinstance(conv, TritonConv2d))
    torch.manual_seed(0)
    a = model_swaps.speed_up_model(create_model("wrn26_6_shakeshake", 10), fold_eval_bn=folded).double().train(train)
    b = copy.deepcopy(a)
    assert use_triton_convs(b) == 4
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    outs = []
    for m in (a, b):
        torch.manual_seed(1)   # the same shake-shake gates
        outs.append(m(x))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-10, atol=1e-12)
    if train:
        for out in outs:
            out.square().sum().backward()
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-12, msg=name)
