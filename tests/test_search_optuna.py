"""The searcher: paper point first, then known points, seeded TPE, ASHA-stopped trials told to Optuna as PRUNED."""
import dataclasses

import optuna
import pytest

from trainables import metrics as M
from trainables.search import intervals
from trainables.search.studies import BudgetAwareOptunaSearch
from trainables.search.plan import parse_args, prepare_search
from trainables.validation import ConfigError
import search_spaces.cifar10_cowmix as cowmix


def make_searcher(seed=0):
    plan = prepare_search(cowmix.BASE, cowmix.SPACE, cowmix.SEARCH, parse_args(cowmix.SEARCH, ["--epochs", "10"]))
    return BudgetAwareOptunaSearch(cowmix.SPACE, plan.epochs, metric=M.VAL_ERROR_TEACHER, mode="min",
                                   points_to_evaluate=plan.points, sampler=optuna.samplers.TPESampler(seed=seed))


def test_paper_point_first_then_seeded_samples():
    a, b = make_searcher(), make_searcher()
    first = a.suggest("t0")
    assert first["mix"]["sigma_range"] == [4.0, 16.0] or abs(first["mix"]["sigma_range"][0] - 4.0) < 1e-9
    assert first["mix"]["weight"] == 30.0 and first["teacher"]["alpha"] == 0.97
    b.suggest("t0")
    assert a.suggest("t1") == b.suggest("t1")          # TPE is seeded: the same search proposes the same configs


def test_stopped_trials_are_pruned_not_complete():
    s = make_searcher()
    for tid in ("full", "stopped"):
        s.suggest(tid)
    for epoch in range(1, 11):
        s.on_trial_result("full", {M.VAL_ERROR_TEACHER: 0.5 - 0.01 * epoch, M.EPOCH: epoch})
    for epoch in (1, 2):
        s.on_trial_result("stopped", {M.VAL_ERROR_TEACHER: 0.9, M.EPOCH: epoch})
    s.on_trial_complete("full", {M.VAL_ERROR_TEACHER: 0.4, M.EPOCH: 10})
    # ASHA stopped it on its epoch-3 result, which Tune passes to on_trial_complete only, never to on_trial_result
    s.on_trial_complete("stopped", {M.VAL_ERROR_TEACHER: 0.9, M.EPOCH: 3})
    trials = {t.number: t for t in s._ot_study.get_trials(deepcopy=False)}
    assert trials[0].state == optuna.trial.TrialState.COMPLETE and trials[0].value == 0.4
    assert trials[1].state == optuna.trial.TrialState.PRUNED
    assert trials[1].intermediate_values == {1: 0.9, 2: 0.9, 3: 0.9}   # TPE ranks it by how far it got
    assert intervals.decode(cowmix.SPACE, trials[1].params)["mix"]["prop_range"][0] < 1.0


def test_known_points_follow_the_paper_point_and_set_only_space_fields():
    settings = dataclasses.replace(cowmix.SEARCH, points=({"mix": {"weight": 3.0}},))
    plan = prepare_search(cowmix.BASE, cowmix.SPACE, settings, parse_args(settings, []))
    s = BudgetAwareOptunaSearch(cowmix.SPACE, plan.epochs, metric=M.VAL_ERROR_TEACHER, mode="min",
                                points_to_evaluate=plan.points)
    first, second = s.suggest("t0"), s.suggest("t1")
    assert first["mix"]["weight"] == 30.0 and second["mix"]["weight"] == 3.0
    assert second["teacher"]["alpha"] == 0.97                    # what a point leaves out stays the paper's
    default = prepare_search(cowmix.BASE, cowmix.SPACE, cowmix.SEARCH, parse_args(cowmix.SEARCH, []))
    assert plan.fingerprint != default.fingerprint               # a restore never mixes the two searches
    outside = dataclasses.replace(cowmix.SEARCH, points=({"optim": {"l2": 0.001}},))
    with pytest.raises(ConfigError, match="SearchSettings.points must set only fields of the search space"):
        prepare_search(cowmix.BASE, cowmix.SPACE, outside, parse_args(outside, []))


def test_a_trial_left_running_by_a_killed_driver_ends_as_fail_with_the_reason(tmp_path, capsys):
    """After a round nothing else runs the search's trials: one still RUNNING in the study was asked before the
    driver died, in a Tune trial that Ray had not saved (and ran again as another trial)."""
    import optuna

    from trainables.search.studies import ORPHANED, end_orphaned_trials

    study = optuna.create_study(study_name="s", storage=f"sqlite:///{tmp_path / 's.db'}")
    study.tell(study.ask(), 0.5)
    study.ask()                                    # asked, never told: the driver died
    end_orphaned_trials(optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 's.db'}"))
    states = [(t.state, t.user_attrs.get(ORPHANED, "")) for t in optuna.load_study(
        study_name="s", storage=f"sqlite:///{tmp_path / 's.db'}").trials]
    assert states[0] == (optuna.trial.TrialState.COMPLETE, "")
    assert states[1][0] == optuna.trial.TrialState.FAIL and states[1][1].startswith("asked before the driver died")
    assert "Optuna trial 1: asked before the driver died" in capsys.readouterr().out
    end_orphaned_trials(None)                      # no study database: nothing to do


def test_a_restored_searcher_leaves_alone_a_trial_the_study_ended_after_ray_saved_it(tmp_path):
    """The driver told Optuna that trial 0 ended (and trial 1 reported epoch 2) after Ray last saved the searcher,
    then died. Restored from Ray's file, the searcher reads the study: Ray runs trial 0 on from its checkpoint and
    its reports and end change nothing (before, the first raised UpdateFinishedTrialError and the resumed search
    failed); trial 1's epoch 2 is not reported twice, and its later epochs are."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    storage = optuna.storages.RDBStorage(url)
    plan = prepare_search(cowmix.BASE, cowmix.SPACE, cowmix.SEARCH, parse_args(cowmix.SEARCH, ["--epochs", "3"]))
    s = BudgetAwareOptunaSearch(cowmix.SPACE, plan.epochs, metric=M.VAL_ERROR_TEACHER, mode="min",
                                points_to_evaluate=plan.points, study_name="s", storage=storage)
    for tid in ("t0", "t1"):
        s.suggest(tid)
        s.on_trial_result(tid, {M.VAL_ERROR_TEACHER: 0.6, M.EPOCH: 1})
    s.save(str(tmp_path / "searcher.pkl"))                        # Ray's last save before the kill
    for epoch in (2, 3):
        s.on_trial_result("t0", {M.VAL_ERROR_TEACHER: 0.5, M.EPOCH: epoch})
    s.on_trial_complete("t0", {M.VAL_ERROR_TEACHER: 0.4, M.EPOCH: 3})
    s.on_trial_result("t1", {M.VAL_ERROR_TEACHER: 0.7, M.EPOCH: 2})

    restored = BudgetAwareOptunaSearch(cowmix.SPACE, plan.epochs, metric=M.VAL_ERROR_TEACHER, mode="min",
                                       study_name="s", storage=storage)
    restored.restore(str(tmp_path / "searcher.pkl"))
    restored.on_trial_result("t0", {M.VAL_ERROR_TEACHER: 0.45, M.EPOCH: 3})   # Ray re-runs its last epoch
    restored.on_trial_complete("t0", {M.VAL_ERROR_TEACHER: 0.45, M.EPOCH: 3})
    for epoch in (2, 3):
        restored.on_trial_result("t1", {M.VAL_ERROR_TEACHER: 0.3, M.EPOCH: epoch})
    restored.on_trial_complete("t1", {M.VAL_ERROR_TEACHER: 0.3, M.EPOCH: 3})
    t0, t1 = optuna.load_study(study_name="s", storage=url).trials
    assert (t0.state, t0.value, t0.intermediate_values) == (optuna.trial.TrialState.COMPLETE, 0.4,
                                                            {1: 0.6, 2: 0.5, 3: 0.5})
    assert (t1.state, t1.value, t1.intermediate_values) == (optuna.trial.TrialState.COMPLETE, 0.3,
                                                            {1: 0.6, 2: 0.7, 3: 0.3})
