"""The confirm stage: after a search round, its leading trials and the paper's config train again on fresh seeds.

Every search trial trains on the same seed (the base config's), so trials are compared on equal terms but the
leader is partly that seed's luck. Here the ``Confirm.finalists`` best full-budget trials and the paper's config
(trial 1) each train on ``Confirm.seeds``, the same seeds for all (paired), as one Ray Tune grid of full configs
(a Ray experiment ``<round>-confirm-<hash>`` beside the round's, restored like it when the driver dies); with
``Confirm.halvings`` the better half goes on to as many seeds again. ``trainables.search.gate`` judges the runs;
the parent MLflow run gets the table, each finalist's mean ± std and p-value against the paper's, the noise of one
trial at each of ASHA's rungs and how well the rungs rank the full budget (Kendall's tau), and ``confirm.json``,
which ``cowtune promote`` reads. The runs are child runs of the parent, tagged ``cowtune.stage=confirm``.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from mlflow.entities import Metric, RunTag
from mlflow.tracking import MlflowClient
from ray import tune

from trainables import metrics as M
from trainables.search import experiments, gate, intervals, mlflow_runs, progress
from trainables.search.experiments import FinishChildRuns
from trainables.search.gate import REFERENCE, Candidate
from trainables.search.trial import META, TRAIN_CONFIG, train_trial, trial_resources
from trainables.validation import flatten

STAGE_TAG, CANDIDATE_TAG = mlflow_runs.STAGE_TAG, "cowtune.candidate"
RECORD = "confirm.json"
_dirname = lambda trial: f"confirm_{trial.trial_id}"   # noqa: E731 - not the config: long paths


def is_confirm_run(run: Any) -> bool:
    return run.data.tags.get(STAGE_TAG) == "confirm"


def finalists(uri: str, experiment_id: str, parent_id: str, plan: Any, space: dict[str, Any], objective: str,
              count: int) -> tuple[float | None, list[tuple[str, float, dict[str, Any]]]]:
    """The paper's trial's objective in the search (None if it did not train the full budget) and the ``count``
    best other full-budget search trials as (trial id, objective, config), best first; a trial whose searched
    values equal the paper's is the paper's."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")   # no download bars in the console
    children = [c for c in mlflow_runs.child_runs(uri, experiment_id, parent_id) if not is_confirm_run(c)]
    full = [c for c in children if objective in c.data.metrics and int(c.data.metrics.get(M.EPOCH, -1)) == plan.epochs]
    paper = flatten(plan.base)
    paths = [path for path, _ in intervals.leaves(space)]
    is_paper = lambda c: all(_same(c.data.params.get(p), paper.get(p)) for p in paths)   # noqa: E731
    paper_value = next((c.data.metrics[objective] for c in full if is_paper(c)), None)
    out: list[tuple[str, float, dict[str, Any]]] = []
    client = MlflowClient(uri)
    for c in sorted((c for c in full if not is_paper(c)), key=lambda c: c.data.metrics[objective]):
        if len(out) == count:
            break
        config = yaml.safe_load(mlflow_runs.read_artifact(client, c, "config.yaml"))
        if any(_same_config(config, o[2]) for o in out):   # the same config proposed twice
            continue
        out.append((c.data.tags.get(mlflow_runs.TRIAL_TAG, c.info.run_id), c.data.metrics[objective], config))
    return paper_value, out


def _same(logged: str | None, value: Any) -> bool:
    """A trial's logged parameter (text) against the paper's value, floats to 1e-6."""
    if logged is None:
        return False
    got = yaml.safe_load(logged)
    if isinstance(value, (list, tuple)):
        return isinstance(got, list) and len(got) == len(value) and all(_same(str(g), v) for g, v in zip(got, value))
    if isinstance(value, float) or isinstance(got, float):
        return isinstance(got, (int, float)) and math.isclose(float(got), float(value), rel_tol=1e-6, abs_tol=1e-9)
    return got == value


def _same_config(a: dict[str, Any], b: dict[str, Any]) -> bool:
    strip = lambda d: {k: v for k, v in flatten(d).items() if k != "seed"}   # noqa: E731
    return strip(a) == strip(b)


def run_confirm(plan: Any, space: dict[str, Any], settings: Any, args: Any, uri: str, experiment_id: str,
                parent_id: str, round_path: str) -> dict[str, Any] | None:
    """Runs the stage for the round whose Ray experiment is ``round_path``; returns its record (None: nothing to
    confirm)."""
    confirm, objective = plan.confirm, settings.objective
    paper_value, chosen = finalists(uri, experiment_id, parent_id, plan, space, objective, confirm.finalists)
    if not chosen:
        print(f"confirm: no search trial besides the paper's trained the full {plan.epochs} epochs; nothing to "
              "confirm", flush=True)
        return None
    base = {k: v for k, v in plan.base.items() if k != META}
    configs = {REFERENCE: base, **{tid: cfg for tid, _, cfg in chosen}}
    everyone = [Candidate(REFERENCE, paper_value, window=settings.mean_of_last),
                *(Candidate(tid, value, window=settings.mean_of_last) for tid, value, _ in chosen)]
    racing = list(everyone)
    key = hashlib.sha256(json.dumps([repr(confirm), sorted(configs.items(), key=lambda kv: kv[0])], sort_keys=True,
                                    default=str).encode()).hexdigest()[:8]
    t0 = time.monotonic()
    for k in range(confirm.halvings + 1):
        seeds = confirm.seeds_of_round(k)
        labels = [c.label for c in racing]
        print(f"confirm: {len(labels)} configs (the paper's and {', '.join(labels[1:])}) x seeds "
              f"{', '.join(map(str, seeds))}, {plan.epochs} epochs each; objective {objective}", flush=True)
        _train(plan, args, uri, experiment_id, parent_id, f"{round_path}-confirm-{key}-{k}", configs,
               [(label, seed) for label in labels for seed in seeds], racing, settings.metric, objective)
        if k < confirm.halvings:
            kept = gate.halve(racing)
            for c in racing:
                if c not in kept:
                    c.verdict = f"dropped after {len(c.objective)} seeds (the worse half)"
            racing = kept
    winner = gate.judge(racing, confirm, seeds=len(confirm.seeds) * (confirm.halvings + 1))
    if winner is None:   # the reference's runs failed: nothing to compare against, and nothing recorded to promote
        print(f"confirm: error: the paper's config did not finish all its seeds ({reference_line(racing)}); "
              "run the search command again to finish the stage", file=sys.stderr, flush=True)
        return None
    rungs = asha_rungs(plan.grace, settings.reduction_factor, plan.epochs)
    noise = gate.noise_and_rank(everyone, rungs, settings.mean_of_last)
    runs = sum(len(c.objective) for c in everyone)
    record = gate.to_record(everyone, winner, objective, {
        "winner_config": configs[winner.label], "winner_run_id": _typical_run(uri, experiment_id, parent_id, winner),
        "seeds": sorted({s for c in everyone for s in c.objective}), "rungs": rungs, "noise": noise, "runs": runs,
        "wall_s": time.monotonic() - t0, "confirm": repr(confirm),
        "metric": settings.metric, "window": settings.mean_of_last})
    text = gate.table(everyone, objective)
    _record(uri, parent_id, record, text, noise)
    print(f"confirm: {runs} runs in {time.monotonic() - t0:.0f} s\n{text}\n" + _noise_line(noise) + "\n"
          + (f"confirm: {winner.label} beats the paper's config over seeds; `cowtune promote --search {plan.name}` "
             "promotes it" if winner.label != REFERENCE else
             f"confirm: no finalist beats the paper's config beyond seed noise; `cowtune promote --search "
             f"{plan.name}` promotes the paper's"), flush=True)
    return record


def reference_line(candidates: list[Candidate]) -> str:
    return next(c.verdict for c in candidates if c.label == REFERENCE)


def asha_rungs(grace: int, reduction_factor: int, max_t: int) -> list[int]:
    """The epochs at which ASHA compares trials, and the full budget."""
    rungs, r = [], grace
    while r < max_t:
        rungs.append(r)
        r *= reduction_factor
    return rungs + [max_t]


def _train(plan: Any, args: Any, uri: str, experiment_id: str, parent_id: str, exp_path: str,
           configs: dict[str, dict[str, Any]], pairs: list[tuple[str, int]], candidates: list[Candidate],
           metric: str, objective: str) -> None:
    """One round: a grid of (label, seed) full configs; fills the candidates' objectives and curves."""
    import ray

    specs = [{"config": {**configs[label], "seed": seed}, "label": label, "seed": seed,
              "tags": {STAGE_TAG: "confirm", CANDIDATE_TAG: label, "cowtune.confirm_seed": str(seed)}}
             for label, seed in pairs]
    resources = trial_resources(plan.base["model"], args.cpus_per_trial, ray.cluster_resources().get("GPU", 0),
                                args.gpu_share)
    meta = {"uri": uri, "experiment_id": experiment_id, "parent_run_id": parent_id, "mode": "confirm",
            "git_sha": mlflow_runs.git_sha(), "cpus": args.cpus_per_trial, "gpu": resources.get("gpu", 0),
            "mean_of_last": candidates[0].window, "metric": metric}
    trainable = tune.with_resources(train_trial, resources)
    shown = [] if args.ray_output else [ConfirmProgress(plan.name, objective, "min", plan.epochs, [])]
    if tune.Tuner.can_restore(exp_path):
        tuner = tune.Tuner.restore(exp_path, trainable=trainable, resume_unfinished=True, resume_errored=True)
    else:
        tuner = tune.Tuner(trainable, param_space={TRAIN_CONFIG: tune.grid_search(specs), META: meta},
                           tune_config=tune.TuneConfig(reuse_actors=True, max_concurrent_trials=args.concurrency,
                                                       trial_dirname_creator=_dirname),
                           run_config=tune.RunConfig(name=exp_path.rsplit("/", 1)[-1], storage_path=exp_path.rsplit(
                                                         "/", 1)[0], verbose=progress.verbose(args),
                                                     failure_config=tune.FailureConfig(max_failures=2),
                                                     checkpoint_config=tune.CheckpointConfig(num_to_keep=2),
                                                     callbacks=[FinishChildRuns(uri, experiment_id, parent_id,
                                                                                plan.epochs), *shown]))
    by_label = {c.label: c for c in candidates}
    for r in tuner.fit():
        spec = r.config[TRAIN_CONFIG]
        frame = r.metrics_dataframe
        if r.error or frame is None or objective not in frame or int(frame[M.EPOCH].max()) != plan.epochs:
            why = str(r.error).strip().splitlines()[-1][:200] if r.error else "did not train the full budget"
            print(f"confirm: {spec['label']} seed {spec['seed']} failed: {why}", flush=True)
            continue
        frame = frame.sort_values(M.EPOCH).drop_duplicates(M.EPOCH, keep="last")
        c = by_label[spec["label"]]
        c.objective[spec["seed"]] = float(frame[objective].iloc[-1])
        c.curves[spec["seed"]] = [float(v) for v in frame[metric]]


class ConfirmProgress(progress.SearchProgress):
    """The search's quiet console (``trainables.search.progress``), with one line per run as it ends instead of the
    table (the stage's own table follows at its end). ``cowtune final`` prints its runs the same way (``stage``)."""

    def __init__(self, name: str, metric: str, mode: str, full_epochs: int, params: list[str],
                 stage: str = "confirm") -> None:
        super().__init__(name, metric, mode, full_epochs, params)
        self.stage = stage

    def setup(self, stop: Any = None, num_samples: int | None = None, total_num_samples: int | None = None,
              **info: Any) -> None:
        self._reset()
        self._total = total_num_samples or num_samples or 0
        self._undo = progress.quiet_ray()

    def print_table(self, trials: list) -> None:
        done = len(self._ended)
        lines = []
        for t in trials:
            if t.trial_id in self._recent:
                spec, s = t.config[TRAIN_CONFIG], self._stats(t)
                value = f"{self.metric} {s['last']:.4f}" if s.get("last") is not None else "no result"
                lines.append(f"[{progress.fmt_time(time.monotonic() - self._start)}] {self.stage} {done}/{len(trials)}: "
                             f"{describe(spec)}: {self.state(t)} at epoch {s.get('epoch') or 0}, {value}")
        lines += self._notes.values()
        if not lines:
            lines = [f"[{progress.fmt_time(time.monotonic() - self._start)}] {self.stage}: {done}/{len(trials)} runs done"]
        print("\n".join(lines), flush=True)
        self._last_print, self._changed = time.monotonic(), False
        self._recent, self._notes = [], {}

    def summary(self, trials: list) -> str:
        n = self.counts(trials)
        if (by := experiments.stopped_by()) is not None:   # Tune ends the runs it stops as terminated: count epochs
            done = sum(1 for t in trials if self.state(t) == "terminated" and self._epoch(t) >= (
                self.full_epochs or t.config[TRAIN_CONFIG]["config"]["train"]["epochs"]))
            return f"{self.stage} {self.name} stopped by {by}: {done} of {len(trials)} runs finished"
        return f"{self.stage} {self.name}: {n['terminated']} runs finished, {n['errored']} errored"


def describe(spec: dict[str, Any]) -> str:
    """A run of the grid in words: a confirm run's config and seed, or a final run's dataset, labels and method."""
    if "label" in spec:
        return f"{spec['label']} seed {spec['seed']}"
    labels = "all" if spec["labels"] == -1 else spec["labels"]
    return f"{spec['dataset']} {labels} labels {spec['method']} seed {spec['seed']}"


def _typical_run(uri: str, experiment_id: str, parent_id: str, c: Candidate) -> str | None:
    """The MLflow run of the candidate's seed whose objective is its median: the checkpoint ``promote`` registers."""
    if not c.objective:
        return None
    ordered = sorted(c.objective, key=lambda s: c.objective[s])
    seed = ordered[(len(ordered) - 1) // 2]
    for r in mlflow_runs.child_runs(uri, experiment_id, parent_id):
        if (is_confirm_run(r) and r.data.tags.get(CANDIDATE_TAG) == c.label
                and r.data.tags.get("cowtune.confirm_seed") == str(seed)):
            return r.info.run_id
    return None


def _noise_line(noise: dict[str, float]) -> str:
    std = ", ".join(f"epoch {k.split('.e')[-1]} {100 * v:.2f}" for k, v in noise.items() if k.startswith("noise."))
    tau = ", ".join(f"epoch {k.split('.e')[-1]} {v:.2f}" for k, v in noise.items() if k.startswith("rank."))
    return (f"confirm: one trial's noise (std of the paper's seeds, points): {std or 'n/a'}; Kendall's tau of each "
            f"rung against the full budget over every confirm run: {tau or 'n/a'}")


def _record(uri: str, parent_id: str, record: dict[str, Any], text: str, noise: dict[str, float]) -> None:
    client = MlflowClient(uri)
    now = int(time.time() * 1000)
    metrics = dict(noise)
    for row in record["rows"]:
        name = "paper" if row["label"] == REFERENCE else row["label"]
        metrics[f"confirm.{name}.mean"], metrics[f"confirm.{name}.std"] = row["mean"], row["std"]
        if row["p_value"] is not None:
            metrics[f"confirm.{name}.p_vs_paper"] = row["p_value"]
    metrics = {k: v for k, v in metrics.items() if not math.isnan(v)}
    note = client.get_run(parent_id).data.tags.get("mlflow.note.content", "").split("\n\n**Confirm stage**")[0]
    tags = {"cowtune.confirm.winner": record["winner"], "cowtune.confirm.runs": str(record["runs"]),
            "mlflow.note.content": f"{note}\n\n**Confirm stage** (fresh seeds, paired)\n\n{text}"}
    client.log_batch(parent_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()],
                     tags=[RunTag(k, v) for k, v in tags.items()])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / RECORD
        path.write_text(json.dumps(record, indent=1, default=str))
        client.log_artifact(parent_id, str(path))
        (Path(tmp) / "confirm_table.md").write_text(text + "\n")
        client.log_artifact(parent_id, str(Path(tmp) / "confirm_table.md"))
