"""A search's Optuna study in a database, so that it outlives the driver and a finished search can grow.

``--optuna-storage`` or ``COWTUNE_OPTUNA_STORAGE`` names an SQLAlchemy URL: PostgreSQL on the team stack
(``postgresql+psycopg2://USER:PASSWORD@HOST:5432/optuna``), or any SQLite file. Unset, the study is kept in an SQLite
file beside the search's Ray experiment (``STORAGE/NAME.optuna.db``), where the search's other records are; with
Ray results in an object store (``--storage s3://...``) it lives in the driver's memory and the search cannot grow.

Growing: the same command with a larger ``--trials`` after the search finished runs the missing trials as a further
*round*: a Ray experiment ``NAME-more1`` (then ``-more2``...) beside ``NAME``, whose searcher loads the same study,
so TPE proposes from every trial so far, and whose trials join the same MLflow parent run. ASHA compares the trials
of one round with each other. A round that did not finish resumes, as a search does.

Early stopping and TPE (``BudgetAwareOptunaSearch``): a trial that ASHA stops is told to Optuna as PRUNED, with its
per-epoch teacher errors as intermediate values (each epoch once, a restored search's too), never COMPLETE: TPE ranks
it below every trial that got further.

What a search's MLflow parent run shows when a round ends: the best trial's error and settings, a description of
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

import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from mlflow.entities import Metric, RunTag
from mlflow.tracking import MlflowClient
from ray import tune
from ray.tune.search.optuna import OptunaSearch

from trainables import metrics as M
from trainables.search import intervals, mlflow_runs
from trainables.search.experiments import experiment_path
from trainables.validation import ConfigError, flatten

ENV = "COWTUNE_OPTUNA_STORAGE"
ROUNDS_TAG = "cowtune.rounds_done"   # on the MLflow parent run: how many rounds (Ray experiments) ended


@dataclass(frozen=True)
class Round:
    index: int          # 0: the search's first Ray experiment
    num_samples: int    # trials it adds (a resumed round: unused, Tune restores its own)
    before: int         # trials of the rounds before it
    paths: tuple[str, ...]   # the Ray experiment folders of every round up to this one, this one's last


def storage_url(arg: str | None) -> str | None:
    return arg or os.environ.get(ENV) or None


def shown(url: str) -> str:
    """The URL with its password hidden, for messages."""
    from sqlalchemy.engine import make_url
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:   # noqa: BLE001 - not a URL at all: say so with the text as given
        return url


def open_storage(url: str, timeout_s: int = 5) -> optuna.storages.RDBStorage:
    """The study database, connected once now: a bad URL, a missing driver or a server that does not answer is one
    ConfigError line before Ray starts."""
    args = {"connect_args": {"connect_timeout": timeout_s}} if url.startswith("postgresql") else {}
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=args)
    except Exception as exc:   # noqa: BLE001 - SQLAlchemy's and the drivers' errors have no common base
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = "" if "://" in url else " (give an SQLAlchemy URL, e.g. sqlite:///optuna.db)"
        raise ConfigError(f"the Optuna storage {shown(url)} ({ENV} or --optuna-storage) could not be opened: "
                          f"{reason}{hint}") from None


def default_storage(storage_dir: str, name: str) -> optuna.storages.RDBStorage | None:
    """The study's SQLite file beside the search's Ray experiment, or None for Ray results in an object store."""
    return None if "://" in storage_dir else open_storage(f"sqlite:///{experiment_path(name, storage_dir)}.optuna.db")


def describe(round_: Round, storage: optuna.storages.RDBStorage | None) -> str:
    """What the search's first line says of its study and round."""
    if storage is None:
        return ""
    grows = f", round {round_.index + 1}: {round_.num_samples} trials after its {round_.before}" if round_.index else ""
    return f"; Optuna study {shown(storage.url)}{grows}"


def round_path(base: str, index: int) -> str:
    return base if index == 0 else f"{base}-more{index}"


def round_paths(base: str) -> list[str]:
    """The Ray experiment folders of every round so far, first to last."""
    paths, i = [], 0
    while tune.Tuner.can_restore(round_path(base, i)):
        paths.append(round_path(base, i))
        i += 1
    return paths


def next_round(name: str, storage_dir: str, trials: int, storage: optuna.storages.BaseStorage | None) -> Round:
    """Which Ray experiment this run of the search command drives: a new search, an unfinished round to resume, or
    (with a study database, the last round ended, ``trials`` above the trials its rounds ran) a new round of the
    rest."""
    base = experiment_path(name, storage_dir)
    paths = round_paths(base) if storage is not None else []
    if not paths:
        return Round(0, trials, 0, (base,))
    last = len(paths) - 1
    have = sum(len(tune.ExperimentAnalysis(p).trials) for p in paths)   # one Optuna trial each
    if rounds_done(name, base) <= last or have >= trials:
        return Round(last, trials, have, tuple(paths))   # resume it (a finished one reports again)
    return Round(last + 1, trials - have, have, (*paths, round_path(base, last + 1)))


def rounds_done(name: str, base: str) -> int:
    uri = mlflow_runs.resolve_tracking_uri()
    experiment = MlflowClient(uri).get_experiment_by_name(name)
    parent = mlflow_runs.find_parent(uri, experiment.experiment_id, base) if experiment is not None else None
    return int(parent.data.tags.get(ROUNDS_TAG, "0")) if parent is not None else 0


ORPHANED = "cowtune.orphaned"


def end_orphaned_trials(study: optuna.Study | None) -> None:
    """After a round, end as FAIL (with the reason as user attribute ``cowtune.orphaned``) the study's trials still
    RUNNING: asked of Optuna before the driver died, in a Tune trial Ray had not yet saved, which Ray therefore ran
    again as another trial (one driver at a time runs a search, so nothing else is running them). Kept for the
    record; TPE does not learn from them."""
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)) if study else ():
        why = "asked before the driver died, in a Tune trial Ray had not saved; Ray ran its slot again as another trial"
        study._storage.set_trial_user_attr(t._trial_id, ORPHANED, why)
        study.tell(t.number, state=optuna.trial.TrialState.FAIL)
        print(f"Optuna trial {t.number}: {why}; ended as FAIL", flush=True)


def load(storage: optuna.storages.BaseStorage | None, name: str) -> optuna.Study | None:
    """The search's study as its database holds it after a round, or None (no database, or no study yet)."""
    if storage is None:
        return None
    try:
        return optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        return None


class BudgetAwareOptunaSearch(OptunaSearch):
    """OptunaSearch over a compiled space that decodes intervals and tells stopped trials as PRUNED."""

    def __init__(self, space: dict[str, Any], full_epochs: int, **kw: Any):
        self._cow_space, self._full_epochs = space, full_epochs
        dists = {name: (optuna.distributions.FloatDistribution(spec[1], spec[2], log=spec[3]) if spec[0] == "float"
                        else optuna.distributions.CategoricalDistribution(spec[1]))
                 for name, spec in intervals.space_params(space).items()}
        super().__init__(dists, **kw)

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        if trial_id not in self._ot_trials:
            self._ot_trials[trial_id] = self._ot_study.ask(fixed_distributions=self._space)
        return intervals.decode(self._cow_space, self._ot_trials[trial_id].params)

    def restore(self, checkpoint_path: str) -> None:
        """Ray's saved searcher, brought up to what the study's database holds since: a driver killed after it told
        Optuna that a trial ended (or reported an epoch) but before Ray saved this searcher restores that trial as
        running, and Ray runs it on from its checkpoint; its reports are then the database's already (reporting
        to an ended trial raises UpdateFinishedTrialError)."""
        super().restore(checkpoint_path)
        for trial_id, trial in self._ot_trials.items():
            trial._cached_frozen_trial = self._ot_study._storage.get_trial(trial._trial_id)
            if trial._cached_frozen_trial.state.is_finished():
                self._completed_trials.add(trial_id)

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        trial = self._ot_trials[trial_id]
        if trial_id not in self._completed_trials and int(result.get(M.EPOCH, 0)) not in \
                {0, *trial._cached_frozen_trial.intermediate_values}:   # each epoch once
            trial.report(result[self.metric], int(result[M.EPOCH]))

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if result and not error and trial_id not in self._completed_trials:
            self.on_trial_result(trial_id, result)   # the last epoch: ASHA's stop, or in a restored search, comes only here
            if result.get(M.EPOCH, 0) < self._full_epochs:
                self._ot_study.tell(self._ot_trials[trial_id], state=optuna.trial.TrialState.PRUNED)
                self._completed_trials.add(trial_id)
                return
        super().on_trial_complete(trial_id, result, error)


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
