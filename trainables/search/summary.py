"""What a search's MLflow parent run shows when a round ends: the best trial's error and settings, a description of
the search, and the Optuna study's plots.

- Metrics (the runs table's columns): the best full-budget trial's ``val/error_teacher`` under the same key as the
  trials', ``best.<field>`` for each of its searched values (a range as ``.lo`` and ``.hi``), and
  ``search.trials_complete`` / ``_pruned`` / ``_failed``. Logged again at each round (step = round), so a grown
  search shows its new best.
- ``best.<field>`` tags hold the same values as text; ``mlflow.note.content`` (the run's Description) says what was
  searched, with what budget, how many trials ASHA stopped, the best, and how to promote it.
- Artifacts under ``optuna/``: optimisation history, parameter importances, parallel coordinates, and each range
  field drawn as one interval per trial coloured by its error.
"""
from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import optuna
from mlflow.entities import Metric, RunTag
from mlflow.tracking import MlflowClient

from trainables.search import intervals, mlflow_runs
from trainables.validation import flatten

PLOT_DIR = "optuna"


UI = "http://127.0.0.1:5000"   # where `mlflow ui` serves an embedded store


def ui_link(uri: str, experiment_id: str) -> str:
    """Where to look at a search: the runs table of its experiment in the MLflow UI's model-training view, its tab
    route named (MLflow 3.17's hash route ``#/experiments/<id>/runs``; ``workflowType`` in the URL wins over the view
    the browser last used, and without it a new browser starts in the GenAI view), after `mlflow ui` for an
    embedded store."""
    page = f"/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
    if mlflow_runs.is_embedded(uri):
        return f"`mlflow ui --backend-store-uri sqlite:///mlflow.db` at {UI}{page}"
    return f"{uri.rstrip('/')}{page}"


def searched_values(space: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """A trial's Optuna parameters as config values by dotted field, e.g. {"mix.sigma_range": [4.1, 15.8]}."""
    return flatten(intervals.decode(space, params))


def best_metrics(values: dict[str, Any]) -> dict[str, float]:
    out = {}
    for field, v in values.items():
        if isinstance(v, (list, tuple)) and len(v) == 2:
            out[f"best.{field}.lo"], out[f"best.{field}.hi"] = float(v[0]), float(v[1])
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"best.{field}"] = float(v)
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def description(name: str, space: dict[str, Any], epochs: int, grace: int, target: int, counts: dict[str, int],
                best: optuna.trial.FrozenTrial | None, metric: str, rounds: int) -> str:
    lines = [f"**Search `{name}`**: Optuna TPE over {len(list(intervals.leaves(space)))} fields, ASHA early "
             f"stopping (grace {grace} epochs), {epochs} epochs per trial, {target} trials"
             + (f" in {rounds} rounds" if rounds > 1 else "") + ".", "",
             f"Trials: {counts['complete']} trained the whole budget, {counts['pruned']} stopped early by ASHA, "
             f"{counts['failed']} failed.", "", "| field | searched |", "|---|---|"]
    lines += [f"| `{path}` | {dom!r} |" for path, dom in intervals.leaves(space)]
    if best is not None:
        lines += ["", f"**Best** (Optuna trial {best.number}): {metric} = {best.value:.4f}", ""]
        lines += [f"- `{k}` = {_fmt(v)}" for k, v in searched_values(space, best.params).items()]
    lines += ["", f"Promote it: `cowtune promote --search {name} --out promoted.yaml`"]
    return "\n".join(lines)


def counts_of(study: optuna.Study) -> dict[str, int]:
    states = [t.state for t in study.get_trials(deepcopy=False)]
    S = optuna.trial.TrialState
    return {"complete": states.count(S.COMPLETE), "pruned": states.count(S.PRUNED), "failed": states.count(S.FAIL)}


def record(uri: str, parent_id: str, study: optuna.Study | None, space: dict[str, Any], plan: Any, metric: str,
           round_index: int) -> None:
    """Write the summary of ``study`` (None: nothing to write) onto the parent run of ``plan`` (its name, epochs,
    grace and num_samples); a failure here only warns (the trials' own records are complete)."""
    if study is None:
        return
    try:
        _record(uri, parent_id, study, space, plan.name, plan.epochs, plan.grace, plan.num_samples, metric,
                round_index)
    except Exception as exc:   # noqa: BLE001 - a summary must never fail a finished search
        warnings.warn(f"search summary on MLflow run {parent_id} not written: {type(exc).__name__}: {exc}", stacklevel=1)


def _record(uri: str, parent_id: str, study: optuna.Study, space: dict[str, Any], name: str, epochs: int, grace: int,
            target: int, metric: str, round_index: int) -> None:
    client = MlflowClient(uri)
    counts = counts_of(study)
    best = study.best_trial if counts["complete"] else None
    now, step = int(time.time() * 1000), round_index
    metrics = {f"search.trials_{k}": float(v) for k, v in counts.items()}
    tags = {"mlflow.note.content": description(name, space, epochs, grace, target, counts, best, metric,
                                               round_index + 1)}
    if best is not None:
        values = searched_values(space, best.params)
        metrics.update({metric: float(best.value), **best_metrics(values)})
        tags.update({f"best.{k}": _fmt(v) for k, v in values.items()})
        tags["best.optuna_trial"] = str(best.number)
    client.log_batch(parent_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()],
                     tags=[RunTag(k, v) for k, v in tags.items()])
    with tempfile.TemporaryDirectory() as d:
        for path in plots(study, space, Path(d)):
            client.log_artifact(parent_id, str(path), PLOT_DIR)


def plots(study: optuna.Study, space: dict[str, Any], out: Path) -> list[Path]:
    """The study's plots as PNGs in ``out``: each one that can be drawn (importances need two complete trials)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as ovm

    drawn = []
    makers = {"history.png": lambda: ovm.plot_optimization_history(study),
              "importances.png": lambda: ovm.plot_param_importances(study),
              "parallel_coordinates.png": lambda: ovm.plot_parallel_coordinate(study),
              "ranges.png": lambda: range_plot(study, space)}
    for file, make in makers.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")   # optuna's "experimental" warnings on each matplotlib plot
                ax = make()
            fig = (ax.flat[0] if hasattr(ax, "flat") else ax).figure
            fig.set_size_inches(max(fig.get_size_inches()[0], 8), max(fig.get_size_inches()[1], 5))
            fig.tight_layout()
            fig.savefig(out / file, dpi=100)
            plt.close(fig)
            drawn.append(out / file)
        except (ValueError, RuntimeError, ZeroDivisionError, IndexError):
            plt.close("all")   # too few trials for this plot: the others are still drawn
    return drawn


def range_plot(study: optuna.Study, space: dict[str, Any]) -> Any:
    """Each range field (CowMask's sigma and p ranges) as one vertical interval per finished trial, coloured by the
    trial's error (its last reported one for a pruned trial)."""
    import matplotlib.pyplot as plt

    fields = [path for path, dom in intervals.leaves(space) if isinstance(dom, intervals.Interval)]
    trials = [t for t in study.get_trials(deepcopy=False)
              if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)]
    if not fields or not trials:
        raise ValueError("no range field or no finished trial")
    err = [t.value if t.value is not None else t.intermediate_values[max(t.intermediate_values)] for t in trials]
    lo_e, hi_e = min(err), max(err)
    cmap = plt.get_cmap("viridis")
    fig, axes = plt.subplots(1, len(fields), figsize=(6 * len(fields), 4.5), squeeze=False)
    for ax, field in zip(axes[0], fields):
        for t, e in zip(trials, err):
            lo, hi = searched_values(space, t.params)[field]
            colour = cmap(0.5 if hi_e == lo_e else (e - lo_e) / (hi_e - lo_e))
            ax.plot([t.number, t.number], [lo, hi], color=colour, lw=3,
                    ls="-" if t.state == optuna.trial.TrialState.COMPLETE else ":")
        if space_domain(space, field).log:
            ax.set_yscale("log")
        ax.set_xlabel("Optuna trial (dotted: stopped early)")
        ax.set_title(f"{field} per trial (colour: error {lo_e:.3f} dark .. {hi_e:.3f} light)")
        ax.grid(alpha=0.3)
    return axes


def space_domain(space: dict[str, Any], field: str) -> Any:
    return dict(intervals.leaves(space))[field]
