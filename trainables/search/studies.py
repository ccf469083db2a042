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
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import optuna
from mlflow.tracking import MlflowClient
from ray import tune
from ray.tune.search.optuna import OptunaSearch

from trainables import metrics as M
from trainables.search import intervals, mlflow_runs
from trainables.search.experiments import experiment_path
from trainables.validation import ConfigError

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
