"""The confirm stage's arithmetic: who beats the paper's config over seeds, and how noisy one trial is.

Plain Python, numpy and scipy (no Ray, no MLflow), so the rules are tested on numbers alone. A *run* is one
(config, seed) training: its objective at the full budget and its per-epoch curve of the tracked error. The
search chose its finalists on one seed, so a finalist's lead there is partly luck; here every finalist and the
paper's config (the reference, the search's trial 1) train on the same fresh seeds, and a finalist wins only if

- its mean over those seeds is below the reference's, by a one-sided paired t-test at ``Confirm.alpha``
  (paired: seed N is the same labeled subset, initialisation and data order for every config);
- its seeds agree: their standard deviation is at most ``Confirm.max_std``;
- none of its seeds diverges late: at the full budget a seed's objective (its error averaged over the objective's
  window of epochs) is at most ``Confirm.max_rise`` above the lowest that average reached earlier in the run.

Among the finalists that pass, the lowest mean wins; when none passes, the reference does: a config that was
better only by seed luck is not promoted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import stats

from trainables.validation import check

REFERENCE = "paper"


@dataclass(frozen=True, kw_only=True)
class Confirm:
    """What a search file declares about its confirm stage (``SearchSettings.confirm``)."""
    finalists: int = 3                   # leading full-budget trials re-run, besides the reference
    seeds: tuple[int, ...] = (1, 2, 3)   # fresh training seeds, the same for every config (paired)
    halvings: int = 0                    # successive halving over seeds: keep the better half, add len(seeds) seeds
    alpha: float = 0.1                   # one-sided paired t-test level against the reference
    max_std: float = 0.03                # seeds' standard deviation of the objective above this: unstable
    max_rise: float = 0.03               # a seed's final objective above its own best window by more: diverging

    def __post_init__(self) -> None:
        check(self.finalists >= 1, "Confirm.finalists", "be >= 1", self.finalists)
        check(len(self.seeds) >= 3, "Confirm.seeds", "hold at least 3 seeds (a mean of fewer is an anecdote)",
              list(self.seeds))
        check(len(set(self.seeds)) == len(self.seeds), "Confirm.seeds", "be distinct", list(self.seeds))
        check(self.halvings >= 0, "Confirm.halvings", "be >= 0", self.halvings)
        check(0 < self.alpha < 1, "Confirm.alpha", "be in (0, 1)", self.alpha)
        check(self.max_std > 0 and self.max_rise > 0, "Confirm.max_std/max_rise", "be > 0",
              (self.max_std, self.max_rise))

    def seeds_of_round(self, k: int) -> tuple[int, ...]:
        """Round k's seeds: ``seeds`` for round 0, then as many new ones after the largest so far."""
        step = max(self.seeds) + 1 - min(self.seeds)
        return tuple(s + k * step for s in self.seeds)


@dataclass
class Candidate:
    """One config of the confirm stage: the reference or a finalist, with its runs by seed."""
    label: str                          # REFERENCE or the search trial's id
    search_value: float | None          # its objective in the search (one seed); None for the reference's own
    objective: dict[int, float] = field(default_factory=dict)     # seed -> objective at the full budget
    curves: dict[int, list[float]] = field(default_factory=dict)  # seed -> the tracked error per epoch
    window: int = 1                     # epochs the objective averages (``SearchSettings.mean_of_last``)
    verdict: str = ""
    p_value: float | None = None

    @property
    def values(self) -> np.ndarray:
        return np.array([self.objective[s] for s in sorted(self.objective)])

    @property
    def mean(self) -> float:
        return float(self.values.mean()) if self.objective else float("nan")

    @property
    def std(self) -> float:
        return float(self.values.std(ddof=1)) if len(self.objective) > 1 else float("nan")

    @property
    def rise(self) -> float:
        """The largest late rise over its seeds: the objective at the last epoch minus the lowest it reached."""
        return max((late_rise(c, self.window) for c in self.curves.values() if c), default=0.0)


def paired_p(candidate: Candidate, reference: Candidate) -> float:
    """One-sided paired t-test p-value that the candidate's objective is lower, over their shared seeds. Identical
    runs (every difference 0) give 1: no evidence of a gain."""
    seeds = sorted(set(candidate.objective) & set(reference.objective))
    if len(seeds) < 2:
        return 1.0
    diff = np.array([candidate.objective[s] - reference.objective[s] for s in seeds])
    if np.allclose(diff, diff[0]):   # no spread: the t statistic is undefined; decide by the sign alone
        return 0.0 if diff[0] < 0 else 1.0
    return float(stats.ttest_rel([candidate.objective[s] for s in seeds], [reference.objective[s] for s in seeds],
                                 alternative="less").pvalue)


def judge(candidates: list[Candidate], confirm: Confirm, seeds: int | None = None) -> Candidate | None:
    """Sets each candidate's verdict and p-value; returns the winner (the reference when no finalist passes), or
    None when the reference's own runs did not all finish (``seeds``: how many each config trained; a finalist with
    fewer finished is not judged)."""
    seeds = seeds or max(len(c.objective) for c in candidates)
    reference = next(c for c in candidates if c.label == REFERENCE)
    if len(reference.objective) < seeds:
        reference.verdict = f"only {len(reference.objective)} of {seeds} seeds finished: nothing can be judged"
        return None
    reference.verdict = "reference"
    passing = []
    for c in candidates:
        if c is reference:
            continue
        if len(c.objective) < seeds:
            c.verdict = f"only {len(c.objective)} of {seeds} seeds finished"
            continue
        c.p_value = paired_p(c, reference)
        why = []
        if c.mean >= reference.mean:
            why.append(f"mean not below the paper's ({100 * c.mean:.2f} >= {100 * reference.mean:.2f}%)")
        elif c.p_value > confirm.alpha:
            why.append(f"gain within seed noise (p {c.p_value:.2f} > {confirm.alpha:g})")
        if not c.std <= confirm.max_std:
            why.append(f"seeds spread {100 * c.std:.1f} > {100 * confirm.max_std:g} points")
        if c.rise > confirm.max_rise:
            why.append(f"a seed rises {100 * c.rise:.1f} > {100 * confirm.max_rise:g} points after its best")
        c.verdict = "; ".join(why) or "passes"
        if not why:
            passing.append(c)
    winner = min(passing, key=lambda c: c.mean) if passing else reference
    winner.verdict = ("promoted" if winner is not reference else
                      "promoted: no finalist beats it beyond seed noise")
    return winner


def halve(candidates: list[Candidate]) -> list[Candidate]:
    """Successive halving over seeds: the better half of the finalists by mean (at least one) and the reference."""
    finalists = sorted((c for c in candidates if c.label != REFERENCE), key=lambda c: c.mean)
    keep = finalists[:max(1, math.ceil(len(finalists) / 2))]
    return [c for c in candidates if c.label == REFERENCE] + keep


def tail_at(curve: list[float], epoch: int, last: int) -> float:
    """The objective a trial reports at ``epoch`` (1-based): the mean of the tracked error over the last ``last``
    epochs up to it (fewer at the start)."""
    window = curve[max(0, epoch - last):epoch]
    return float(np.mean(window))


def late_rise(curve: list[float], last: int) -> float:
    """How far a run's objective at its last epoch lies above the lowest it reached (its window full or not)."""
    values = [tail_at(curve, e, last) for e in range(1, len(curve) + 1)]
    return values[-1] - min(values)


def noise_and_rank(candidates: list[Candidate], rungs: list[int], last: int) -> dict[str, float]:
    """How noisy one trial is at each fidelity the search uses, and how well short trials rank long ones:

    - ``noise.std.e<R>``: the standard deviation over the reference's seeds of its objective at rung R;
    - ``rank.tau.e<R>``: Kendall's tau between every run's objective at rung R and at the full budget (the last
      rung), over all runs of the stage (configs x seeds).
    """
    out: dict[str, float] = {}
    reference = next(c for c in candidates if c.label == REFERENCE)
    runs = [c.curves[s] for c in candidates for s in sorted(c.curves) if c.curves[s]]
    full = max(rungs)
    for r in rungs:
        ref = [tail_at(c, r, last) for c in reference.curves.values() if len(c) >= r]
        if len(ref) > 1:
            out[f"noise.std.e{r}"] = float(np.std(ref, ddof=1))
        pairs = [(tail_at(c, r, last), tail_at(c, full, last)) for c in runs if len(c) >= full]
        if r < full and len(pairs) >= 3:
            tau = stats.kendalltau(*zip(*pairs)).statistic
            if not math.isnan(tau):
                out[f"rank.tau.e{r}"] = float(tau)
    return out


def table(candidates: list[Candidate], objective: str) -> str:
    """A Markdown table of the stage: each config's mean ± std over seeds, every seed, p against the paper."""
    seeds = sorted({s for c in candidates for s in c.objective})
    lines = [f"| config | search (1 seed) | {objective}, mean ± std over seeds {', '.join(map(str, seeds))} | "
             "per seed | largest late rise | p vs paper | verdict |", "|---|---|---|---|---|---|---|"]
    for c in candidates:
        per_seed = " / ".join(f"{100 * c.objective[s]:.2f}" if s in c.objective else "-" for s in seeds)
        search = "" if c.search_value is None else f"{100 * c.search_value:.2f}%"
        p = "" if c.p_value is None else f"{c.p_value:.3f}"
        mean = f"{100 * c.mean:.2f} ± {100 * c.std:.2f}%" if c.objective else "-"
        lines.append(f"| {c.label} | {search} | {mean} | {per_seed} | "
                     f"{100 * c.rise:.1f} | {p} | {c.verdict} |")
    return "\n".join(lines)


def to_record(candidates: list[Candidate], winner: Candidate, objective: str, extra: dict[str, Any]) -> dict[str, Any]:
    """What the parent run keeps (``confirm.json``) and ``cowtune promote`` reads."""
    rows = [{"label": c.label, "search_value": c.search_value, "mean": c.mean, "std": c.std, "rise": c.rise,
             "p_value": c.p_value, "verdict": c.verdict, "objective": {str(s): v for s, v in c.objective.items()}}
            for c in candidates]
    return {"objective": objective, "winner": winner.label, "rows": rows, **extra}
