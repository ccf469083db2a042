"""Batch statistics from shifted sums (``SegmentedBatchNorm2d.sum_stats``, an experiment for A/B timings): the same
statistics, outputs, gradients and running statistics as ``torch.var_mean``'s, and under torch.compile a lowering
without Inductor's Welford reduction."""
import pytest
import torch

from trainables.segmented_bn import SegmentedBatchNorm2d, batch_segments, convert_batch_norm, shifted_sum_stats


@pytest.mark.parametrize("shape,dim", [((2, 6, 4, 5, 5), (1, 3, 4)), ((7, 3), (0,)), ((3, 4, 9), (0, 2))])
def test_shifted_sum_stats_is_var_mean(shape, dim):
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3 + 2
    var, mean = shifted_sum_stats(x, dim)
    ref_var, ref_mean = torch.var_mean(x, dim=dim, keepdim=True, correction=0)
    assert var.shape == ref_var.shape and mean.shape == ref_mean.shape
    assert torch.allclose(var, ref_var, rtol=1e-12, atol=0) and torch.allclose(mean, ref_mean, rtol=1e-12, atol=1e-12)


def test_shifted_sum_stats_takes_negative_dims():
    x = torch.randn(3, 5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) + 4
    for a, b in zip(shifted_sum_stats(x, (-1, 0)), shifted_sum_stats(x, (0, 2))):
        assert torch.equal(a, b)
    var, mean = shifted_sum_stats(x, (-1,))
    assert torch.allclose(var, x.var(-1, keepdim=True, correction=0), rtol=1e-12)


def test_shifted_sums_keep_float32_precision_far_from_zero():
    """Data of mean 1000 and variance about 1 in float32: the shifted sums give the variance to about 1e-5, where
    sums of x and x^2 alone lose it (1e6 - 1e6 in float32)."""
    x64 = torch.randn(4, 4096, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 1000
    x = x64.float()
    ref = torch.var_mean(x.double(), dim=1, keepdim=True, correction=0)[0]
    var, mean = shifted_sum_stats(x, (1,))
    assert ((var.double() - ref).abs() / ref).max() < 1e-4
    assert torch.allclose(mean.double(), x.double().mean(1, keepdim=True), rtol=1e-6)
    unshifted = (x * x).mean(1, keepdim=True) - x.mean(1, keepdim=True) ** 2
    assert ((unshifted.double() - ref).abs() / ref).max() > 1e-2   # what the shift is for


def _segmented(sum_stats: bool, monkeypatch) -> SegmentedBatchNorm2d:
    monkeypatch.setattr(SegmentedBatchNorm2d, "sum_stats", sum_stats)
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(4).double()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 2)
        bn.bias.uniform_(-1, 1)
    return convert_batch_norm(torch.nn.Sequential(bn))[0]


@pytest.mark.parametrize("relu", [False, True], ids=["bn", "bn-relu"])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_sum_stats_batch_norm_is_the_var_mean_one(relu, memory_format, monkeypatch):
    """The one-pass batch norm of two segments (one updating the running statistics), with and without
    ``sum_stats``: the same outputs, input and parameter gradients and running statistics (float64)."""
    monkeypatch.setattr(SegmentedBatchNorm2d, "one_pass_eager", True)
    x0 = (torch.randn(8, 4, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 2 + 5)
    x0 = x0.contiguous(memory_format=memory_format)
    w = torch.randn(8, 4, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    results = []
    for sum_stats in (False, True):
        bn = _segmented(sum_stats, monkeypatch)
        x = x0.clone().requires_grad_()
        with batch_segments([bn], ((4, True), (4, False))):
            y = bn.forward_relu(x) if relu else bn(x)
        (y * w).sum().backward()
        results.append((y.detach(), x.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var))
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), (a - b).abs().max()
    assert not torch.equal(results[0][4], torch.zeros(4, dtype=torch.float64))   # the running mean moved


def test_sum_stats_compiles_to_sums_not_welford(monkeypatch):
    """Under torch.compile the default statistics are a Welford reduction and ``sum_stats`` ones are not; both give
    the same output. On CPU Inductor takes its two-pass form for var_mean up to 1024 values, so each segment here
    reduces 2048 (on a GPU, float32 statistics are Welford above 8)."""
    from torch._inductor.utils import run_and_get_code

    x = torch.randn(16, 4, 16, 16, generator=torch.Generator().manual_seed(4)) * 2 + 3
    outs, codes = [], []
    for sum_stats in (False, True):
        bn = _segmented(sum_stats, monkeypatch).float()

        def forward(t, bn=bn):
            with batch_segments([bn], ((8, True), (8, True))):
                return bn(t)

        torch._dynamo.reset()
        try:
            out, code = run_and_get_code(torch.compile(forward, backend="inductor"), x)
        finally:
            torch._dynamo.reset()
        outs.append(out)
        codes.append("\n".join(code))
    assert "welford" in codes[0].lower() and "welford" not in codes[1].lower()
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
