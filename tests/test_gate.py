"""The confirm stage's rules on numbers alone (trainables/search/gate.py): who beats the paper's config over seeds."""
import math

import pytest

from trainables import metrics as M
from trainables.search.gate import REFERENCE, Candidate, Confirm, judge, halve, late_rise, noise_and_rank, paired_p, \
    table, tail_at
from trainables.validation import ConfigError


def cand(label, values, curves=None, window=1, search=None):
    c = Candidate(label, search, window=window)
    for seed, v in zip((1, 2, 3, 4, 5, 6), values):
        c.objective[seed] = v
        c.curves[seed] = (curves or {}).get(seed, [v + 0.2, v + 0.05, v])
    return c


def test_a_consistent_paired_gain_is_promoted():
    paper = cand(REFERENCE, [0.30, 0.24, 0.42])
    better = cand("a", [0.20, 0.19, 0.21])
    winner = judge([paper, better], Confirm())
    assert winner is better and better.verdict == "promoted" and better.p_value < 0.1
    assert paper.verdict == "reference"


def test_a_lead_that_was_seed_luck_is_not_promoted():
    """The finalist led in the search (one seed) but on fresh seeds it is the paper's config again: the paper's
    config is the winner."""
    paper = cand(REFERENCE, [0.30, 0.24, 0.42])
    lucky = cand("lucky", [0.31, 0.23, 0.40], search=0.15)
    winner = judge([paper, lucky], Confirm())
    assert winner is paper and "promoted: no finalist beats it" in paper.verdict
    assert "within seed noise" in lucky.verdict


def test_identical_runs_are_no_evidence():
    paper = cand(REFERENCE, [0.30, 0.24, 0.42])
    same = cand("same", [0.30, 0.24, 0.42])
    assert paired_p(same, paper) == 1.0
    assert judge([paper, same], Confirm()) is paper and "not below" in same.verdict


def test_a_wide_spread_or_a_late_rise_does_not_win():
    paper = cand(REFERENCE, [0.40, 0.41, 0.42])
    wide = cand("wide", [0.20, 0.36, 0.27])
    rising = cand("rising", [0.25, 0.26, 0.27], curves={1: [0.5, 0.2, 0.2, 0.25], 2: [0.5, 0.26], 3: [0.5, 0.27]})
    steady = cand("steady", [0.30, 0.31, 0.30])
    winner = judge([paper, wide, rising, steady], Confirm())
    assert winner is steady, [c.verdict for c in (wide, rising, steady)]
    assert "seeds spread" in wide.verdict and "rises 5.0" in rising.verdict


def test_the_rise_reads_the_objective_window_not_one_noisy_epoch():
    jitter = [0.5, 0.3, 0.2, 0.19, 0.23, 0.18, 0.21]   # the last epoch 3 points above the best, the window's mean not
    assert late_rise(jitter, 1) == pytest.approx(0.03)
    assert late_rise(jitter, 3) < 0.01
    assert tail_at(jitter, 4, 3) == pytest.approx((0.3 + 0.2 + 0.19) / 3)
    assert tail_at(jitter, 1, 3) == 0.5                 # fewer epochs at the start
    assert M.window_mean([{"e": 1.0}, {"e": 2.0}, {"e": 4.0}], "e", 2) == 3.0
    assert M.mean_of_last("val/error_teacher", 6) == "val/error_teacher_mean6"
    assert M.mean_of_last("val/error_teacher", 1) == "val/error_teacher"


def test_successive_halving_keeps_the_better_half_and_the_reference():
    cands = [cand(REFERENCE, [0.3] * 3), cand("a", [0.2] * 3), cand("b", [0.25] * 3), cand("c", [0.5] * 3),
             cand("d", [0.22] * 3)]
    assert [c.label for c in halve(cands)] == [REFERENCE, "a", "d"]
    assert [c.label for c in halve(cands[:2])] == [REFERENCE, "a"]


def test_noise_at_each_rung_and_the_rungs_ranking():
    curves = {1: [0.9, 0.5, 0.40, 0.30], 2: [0.9, 0.6, 0.50, 0.40], 3: [0.9, 0.7, 0.60, 0.50]}
    paper = cand(REFERENCE, [0.30, 0.40, 0.50], curves=curves)
    other = cand("a", [0.2, 0.25, 0.28], curves={1: [0.8, 0.3, 0.2, 0.2], 2: [0.8, 0.4, 0.3, 0.25],
                                                  3: [0.8, 0.45, 0.4, 0.28]})
    out = noise_and_rank([paper, other], [2, 4], last=1)
    assert out["noise.std.e2"] == pytest.approx(0.1) and out["noise.std.e4"] == pytest.approx(0.1)
    assert out["rank.tau.e2"] == pytest.approx(1.0)
    assert "rank.tau.e4" not in out                     # the full budget against itself says nothing
    assert "| paper |" in table([paper, other], "obj") and "30.00 / 40.00 / 50.00" in table([paper, other], "obj")


@pytest.mark.parametrize("kw, field", [({"seeds": (1, 2)}, "Confirm.seeds"), ({"seeds": (1, 1, 2)}, "Confirm.seeds"),
                                       ({"finalists": 0}, "Confirm.finalists"), ({"alpha": 1.5}, "Confirm.alpha")])
def test_bad_confirm_settings_are_named(kw, field):
    with pytest.raises(ConfigError, match=field):
        Confirm(**kw)


def test_halving_rounds_take_fresh_seeds():
    c = Confirm(seeds=(1, 2, 3), halvings=2)
    assert [c.seeds_of_round(k) for k in range(3)] == [(1, 2, 3), (4, 5, 6), (7, 8, 9)]
    assert not math.isnan(cand(REFERENCE, [0.1, 0.2, 0.3]).std)


def test_a_finalist_or_reference_with_failed_seeds_is_not_judged():
    paper = cand(REFERENCE, [0.30, 0.24, 0.42])
    short = cand("short", [0.10, 0.11])                 # its third seed failed
    assert judge([paper, short], Confirm(), seeds=3) is paper and "only 2 of 3 seeds" in short.verdict
    broken = cand(REFERENCE, [0.30])
    assert judge([broken, cand("a", [0.2, 0.2, 0.2])], Confirm(), seeds=3) is None
    assert "| short |" in table([paper, short], "obj") and math.isnan(Candidate("x", None).mean)
