"""Top-5 error (the paper's ImageNet table reports it beside top-1): measured by ``step.evaluate`` for more than 10
classes, named ``<split>/error5_<model>``, and summed right over data-parallel shards' sizes."""
import contextlib

import torch
from torch import nn

from trainables import metrics as M
from trainables.step import evaluate


class Fixed(nn.Module):
    """Returns the logits it was given for each input index (x holds the index)."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits

    def forward(self, x):
        return self.logits[x.long().view(-1)]


def batches(n: int, y: torch.Tensor, size: int):
    return [(torch.arange(i, min(i + size, n)).float().view(-1, 1, 1, 1), y[i:i + size]) for i in range(0, n, size)]


def test_top5_error_counts_labels_outside_the_five_highest_logits():
    torch.manual_seed(0)
    logits, y = torch.randn(37, 20), torch.randint(0, 20, (37,))
    s = evaluate(Fixed(logits), batches(37, y, 8), contextlib.nullcontext(), torch.contiguous_format)
    ranks = (logits > logits.gather(1, y[:, None])).sum(1)   # how many classes score above the label's
    assert s.error == (ranks > 0).sum().item() / 37 and s.error5 == (ranks >= 5).sum().item() / 37
    assert 0 < s.error5 < s.error < 1
    assert M.eval_metrics("test", "teacher", s) == {"test/error_teacher": s.error, "test/loss_teacher": s.loss,
                                                   "test/error5_teacher": s.error5}


def test_ten_classes_or_fewer_report_no_top5():
    logits, y = torch.randn(12, 10), torch.randint(0, 10, (12,))
    s = evaluate(Fixed(logits), batches(12, y, 5), contextlib.nullcontext(), torch.contiguous_format)
    assert s.error5 is None and set(M.eval_metrics("val", "student", s)) == {"val/error_student", "val/loss_student"}
    empty = evaluate(Fixed(logits), [], contextlib.nullcontext(), torch.contiguous_format)
    assert empty.error != empty.error and empty.error5 is None
