"""A search's console output: one compact progress table instead of Ray Tune's per-trial dumps.

Ray Tune's output engine prints, with ``verbose=1``, a boxed table of every trial's whole config when it starts,
a boxed result table when it ends and "Trial status" tables; Ray forwards each worker's stdout and stderr
besides. A small search made hundreds of lines. By default a search now runs Tune with ``verbose=0`` and its
legacy output engine (RAY_AIR_NEW_OUTPUT=0, put back when the search ends: at ``verbose=0`` it prints nothing,
where the new engine still prints its "Configuration for experiment" box), and ``SearchProgress`` prints, at most
every ``interval_s`` seconds when something changed and whenever a trial ends, a short fixed-width table: how
many trials run, finished the full budget, were stopped early by ASHA (pruned), errored or wait; one row per
trial (epoch reached, last and best objective, the searched hyperparameters): the running ones, those just ended,
then the finished ones best first (ties: the trial made first, ``trial_number``), up to ``MAX_ROWS``; the best so
far. One summary line at the end. ``--ray-output`` (``plan.parse_args``) gives Ray's own output back, as it
was before, and no table.

What else is quietened while the table is on (``SearchProgress.setup``, undone in ``on_experiment_end``):
- the trainer's routine lines from the trials (``[train_trial_xxxx] data: / model / first step / epoch ...``,
  forwarded by Ray with a ``(train_trial pid=...)`` prefix) and Ray Train's "Checkpoint successfully created"
  line per epoch. None of them is kept: the table already says which epoch each trial reached and its
  objective, every number of an epoch line is in MLflow, and with many concurrent trials of many epochs
  (plus a mid-epoch line every 15 s) they would be thousands of lines again. Everything else a trial prints
  (warnings, tracebacks, "resumed from ...") still comes through. It uses Ray's own log-deduplication skip
  pattern (what RAY_DEDUP_LOGS_SKIP_REGEX sets; a pattern of the user's is kept), so with RAY_DEDUP_LOGS=0
  the lines come through again;
- MLflow's "View run ... / View experiment at" links, two lines per trial from the trial and two more from the
  driver as it ends the trial's run (with a tracking server); the parent run's, after the search, stays;
- Ray Tune's "Wrote the latest version of all result files" note and its warning that experiment snapshots
  are frequent (only very short epochs, as in smoke tests, trigger it; the search chooses ``num_to_keep``).
Errors are left alone: Ray's "Trial task failed" with the traceback, and the table names the trial's error file.

The callback is pickled with the Tuner's RunConfig: a resumed search (``Tuner.restore``) keeps the output mode
it was started with.
"""
from __future__ import annotations

import logging
import math
import os
import re
import time
from typing import Any

from ray import tune

from trainables import metrics as M
from trainables.search import experiments, intervals
from trainables.search.trial import META, REFUSED

# The trainer's routine lines, as trial.train_trial prints them: "[<trial name>] <line>".
TRAINER_LINES = r"^\[\w+_[0-9a-f]{5,8}(?:_\d{5})?\] (?:data: |model |  first step |  epoch |epoch )"
RAY_TRAIN_LINES = r"^Checkpoint successfully created at: "
MLFLOW_LINES = r"^(?:\U0001f3c3 View run \S+ at: |\U0001f9ea View experiment at: )"
MLFLOW_URL_ENV = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"   # the driver's own: read each time a run ends
QUIET_LOGS = {"ray.tune.tune": ("Wrote the latest version of all result files", "Stop signal received",
                               "Experiment has been interrupted"),   # a stop: said by the summary and the driver
              "ray.tune.execution.experiment_state": ("Experiment state snapshotting has been triggered",),
              "ray.tune.analysis.experiment_analysis": ("Failed to fetch metrics for",)}   # trials a stop cut short
MAX_ROWS = 20   # trials beyond this are counted, not listed: the running ones, then the just ended, then the best
ENDED = ("terminated", "pruned", "errored")
ENGINE_ENV = "RAY_AIR_NEW_OUTPUT"   # "0": Tune's legacy output engine; read when fit() starts, before any callback
_ENGINE: dict[str, str | None] = {}   # {"before": the variable's value} while quiet_engine() has it changed


def verbose(args: Any) -> int:
    """Ray Tune's ``verbose``: 0 (its own output off, the table on) unless ``--ray-output`` asks for its output."""
    if args.ray_output:
        restore_engine()
        return args.ray_output
    quiet_engine()
    return 0


def quiet_engine() -> None:
    if "before" not in _ENGINE:
        _ENGINE["before"] = os.environ.get(ENGINE_ENV)
    os.environ[ENGINE_ENV] = "0"


def restore_engine() -> None:
    if "before" in _ENGINE:
        before = _ENGINE.pop("before")
        if before is None:
            os.environ.pop(ENGINE_ENV, None)
        else:
            os.environ[ENGINE_ENV] = before


def callbacks(args: Any, settings: Any, plan: Any, space: dict[str, Any]) -> list[tune.Callback]:
    """The progress table's callback, none with ``--ray-output``."""
    if args.ray_output:
        return []
    return [SearchProgress(plan.name, settings.objective, settings.mode, plan.epochs,
                           [path for path, _ in intervals.leaves(space)])]


def short_names(paths: list[str]) -> dict[str, str]:
    """Each dotted path by its last part, the whole path where two last parts are the same."""
    last = [p.rsplit(".", 1)[-1] for p in paths]
    return {p: (n if last.count(n) == 1 else p) for p, n in zip(paths, last)}


def fmt_value(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v):
        return f"{fmt_value(float(v[0]))}..{fmt_value(float(v[1]))}"
    return str(v)[:16]


def fmt_time(seconds: float) -> str:
    s = int(max(0, seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def lookup(config: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        if not isinstance(config, dict) or part not in config:
            return None
        config = config[part]
    return config


def trial_number(trial: Any) -> int:
    """The order Tune's searcher made ``trial`` in (its ``experiment_tag`` "<n>_...", a trial object's or a result's),
    which a restored search keeps: ties between trials go to the earlier one. Without one it sorts last."""
    tag = trial.get("experiment_tag") if isinstance(trial, dict) else getattr(trial, "experiment_tag", "")
    head = str(tag or "").split("_", 1)[0]
    return int(head) if head.isdigit() else 1 << 30


def best_result(results: Any, metric: str, mode: str) -> Any:
    """``results.get_best_result(metric, mode, scope="last")`` (the best last result), of equals the trial made first
    (``trial_number``; Tune puts the tag in each result): Ray takes the first of equals in its own order of trials,
    which a restore can change. None when no trial reported ``metric``."""
    scored = [r for r in results if r.metrics and isinstance(r.metrics.get(metric), (int, float))
              and math.isfinite(r.metrics[metric])]   # as Ray's filter_nan_and_inf
    sign = 1 if mode == "min" else -1
    return min(scored, key=lambda r: (sign * r.metrics[metric], trial_number(r.metrics)), default=None)


def error_line(trial: Any, limit: int = 160) -> str:
    """The last line of the trial's error file (Ray appends each failure's exception there), shortened."""
    try:
        with open(trial.error_file) as f:
            lines = [line.strip() for line in f if line.strip()]
    except (OSError, TypeError):
        return "no error file"
    line = lines[-1] if lines else "empty error file"
    return line if len(line) <= limit else line[:limit - 3] + "..."


def error_path(trial: Any) -> str:
    """Where the trial's error file stays: under the search's storage (Ray copies it there from the driver's
    staging folder, which ``trial.error_file`` names)."""
    if getattr(trial, "path", None):
        return f"{trial.path}/error.txt"
    return trial.error_file or "none"


class _Drop(logging.Filter):
    def __init__(self, prefix: tuple[str, ...]):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_ray() -> list[tuple[Any, ...]]:
    """Quieten what the module docstring lists; returns what ``unquiet`` needs to undo it."""
    undo: list[tuple[Any, ...]] = []
    for name, prefix in QUIET_LOGS.items():
        f = _Drop(prefix)
        logging.getLogger(name).addFilter(f)
        undo.append(("log", name, f))
    undo.append(("env", MLFLOW_URL_ENV, os.environ.get(MLFLOW_URL_ENV)))
    os.environ[MLFLOW_URL_ENV] = "true"
    try:   # the objects RAY_DEDUP_LOGS_SKIP_REGEX configures; read from the environment when Ray was imported
        from ray._private import ray_logging
    except ImportError:
        return undo
    for dedup in (getattr(ray_logging, n, None) for n in ("stdout_deduplicator", "stderr_deduplicator")):
        if dedup is not None and hasattr(dedup, "skip_re"):
            old = dedup.skip_re
            mine = f"(?:{TRAINER_LINES})|(?:{RAY_TRAIN_LINES})|(?:{MLFLOW_LINES})"
            dedup.skip_re = re.compile(mine if old is None else f"(?:{old.pattern})|{mine}")
            undo.append(("dedup", dedup, old))
    return undo


def unquiet(undo: list[tuple[Any, ...]]) -> None:
    for kind, target, what in reversed(undo):
        if kind == "log":
            logging.getLogger(target).removeFilter(what)
        elif kind == "env":
            if what is None:
                os.environ.pop(target, None)
            else:
                os.environ[target] = what
        else:
            target.skip_re = what


class SearchProgress(tune.Callback):
    """Prints the progress table (see the module docstring). ``params``: the dotted config paths searched."""

    def __init__(self, name: str, metric: str, mode: str, full_epochs: int, params: list[str],
                 interval_s: float = 30.0):
        self.name, self.metric, self.mode, self.full_epochs = name, metric, mode, full_epochs
        self.params, self.interval_s = list(params), interval_s
        self._reset()

    def _reset(self) -> None:
        self._total = 0
        self._start = self._last_print = time.monotonic()
        self._changed = False
        self._seen: dict[str, dict[str, Any]] = {}    # trial id -> epoch, last, best
        self._ended: dict[str, str] = {}             # trial id -> state, for trials Tune has not marked yet
        self._recent: list[str] = []                 # trials ended since the last table
        self._notes: dict[str, str] = {}             # trial id -> its failure, until the next table
        self._undo: list[tuple[Any, ...]] = []

    def __getstate__(self) -> dict[str, Any]:   # pickled with the RunConfig: settings only, no run state
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state: dict[str, Any]) -> None:   # Tuner.restore: before fit(), as verbose() is
        self.__dict__.update(state)
        self._reset()
        quiet_engine()

    # Tune's hooks
    def setup(self, stop: Any = None, num_samples: int | None = None, total_num_samples: int | None = None,
              **info: Any) -> None:
        self._reset()
        self._total = total_num_samples or num_samples or 0
        self._undo = quiet_ray()
        print(f"{self.name}: a progress table every {self.interval_s:g} s and when a trial ends "
              f"(Ray Tune's own output: --ray-output)", flush=True)

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._changed = True

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        value, epoch = result.get(self.metric), result.get(M.EPOCH)
        if value is None:
            return
        s = self._seen.setdefault(trial.trial_id, {"best": None})
        s["epoch"], s["last"] = epoch, value
        if s["best"] is None or self._better(value, s["best"]):
            s["best"] = value
        self._changed = True

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._end(trials, trial, "pruned" if self._epoch(trial) < self.full_epochs else "terminated")

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._notes[trial.trial_id] = (f"  {trial.trial_id} errored after {self._epoch(trial)} epochs: "
                                       f"{error_line(trial)} (traceback: {error_path(trial)})")
        self._end(trials, trial, "errored")

    def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        if (trial.config.get(META) or {}).get(REFUSED):   # a ConfigError: its retry stops at once; said as it errs
            return
        self._notes[trial.trial_id] = (f"  {trial.trial_id} failed ({getattr(trial, 'num_failures', 1)}x) after "
                                       f"{self._epoch(trial)} epochs: {error_line(trial)}; Ray runs it again")
        self._changed = True

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        waited = time.monotonic() - self._last_print
        if (self._changed and waited >= self.interval_s) or waited >= 10 * self.interval_s:
            self.print_table(trials)

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        print(self.summary(trials), flush=True)
        # Stopped by a signal: Tune's notes of it ("interrupted", trials without results) follow this hook, and the
        # driver then says it in one line and exits; its log filters stay on till then
        kept = [u for u in self._undo if u[0] == "log"] if experiments.stopped_by() is not None else []
        unquiet([u for u in self._undo if u not in kept])
        self._undo = []
        restore_engine()

    # The table
    def _end(self, trials: list, trial: Any, state: str) -> None:
        self._ended[trial.trial_id] = state
        self._recent.append(trial.trial_id)
        self.print_table(trials)

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    def _epoch(self, trial: Any) -> int:
        s = self._seen.get(trial.trial_id, {})
        return int(s.get("epoch") or (trial.last_result or {}).get(M.EPOCH) or 0)

    def _stats(self, trial: Any) -> dict[str, Any]:
        """epoch, last, best: from the results this callback saw, else (a restored trial) from Tune's."""
        if trial.trial_id in self._seen:
            return self._seen[trial.trial_id]
        seen = (getattr(trial, "metric_analysis", None) or {}).get(self.metric, {})
        return {"epoch": (trial.last_result or {}).get(M.EPOCH), "last": seen.get("last"),
                "best": seen.get("min" if self.mode == "min" else "max")}

    def state(self, trial: Any) -> str:
        status = trial.status
        if status == "ERROR":
            return "errored"
        if trial.trial_id in self._ended:
            return self._ended[trial.trial_id]
        if status == "TERMINATED":   # not ended through Tune's hooks: ASHA's stop, or a signal's (runs again)
            if self._epoch(trial) >= self.full_epochs:
                return "terminated"
            return "pending" if experiments.stopped_by() is not None else "pruned"
        return status.lower()

    def _rank(self, trial: Any) -> tuple[float, int]:
        """Best last result first; of equals, the trial made first (``trial_number``)."""
        last = self._stats(trial).get("last")
        value = float("inf") if last is None else (last if self.mode == "min" else -last)
        return value, trial_number(trial)

    def _best(self, trials: list) -> Any:
        """The trial with the best last result, of equals the one made first: what the driver's "best trial" line
        ranks by (``best_result``), the same on a first run and a restored one."""
        reported = [t for t in trials if self._stats(t).get("last") is not None]
        return min(reported, key=self._rank) if reported else None

    def counts(self, trials: list) -> dict[str, int]:
        n = {k: 0 for k in ("running", "terminated", "pruned", "errored", "pending")}
        for t in trials:
            s = self.state(t)
            n[s if s in n else "running" if s == "paused" else "pending"] += 1
        n["pending"] += max(0, self._total - len(trials))   # trials the searcher has not proposed yet
        return n

    def _params(self, trial: Any) -> str:
        names = short_names(self.params)
        return " ".join(f"{names[p]}={fmt_value(lookup(trial.config, p))}" for p in self.params)

    def _best_line(self, trials: list) -> str:
        best = self._best(trials)
        if best is None:
            return f"best so far: none (no trial has reported {self.metric} yet)"
        s = self._stats(best)
        at = f" at epoch {s['epoch']}" if s.get("epoch") is not None else ""
        return f"best so far: {best.trial_id} {self.metric} {s['last']:.4f}{at} ({self._params(best)})"

    def table(self, trials: list) -> list[str]:
        """The table's lines (no printing)."""
        n = self.counts(trials)
        total = max(self._total, len(trials))
        head = (f"[{fmt_time(time.monotonic() - self._start)}] {self.name}: {total} trials: "
                + ", ".join(f"{v} {k}" for k, v in n.items()))
        live = [t for t in trials if self.state(t) in ("running", "paused")]
        ended = [t for t in trials if self.state(t) in ENDED]
        rows = live + [t for t in ended if t.trial_id in self._recent] + sorted(
            (t for t in ended if t.trial_id not in self._recent), key=self._rank)   # finished: best first
        more = max(0, len(rows) - MAX_ROWS)
        rows = rows[:MAX_ROWS]
        names = short_names(self.params)
        cells = [["trial", "state", "epoch", "last", "best", *(names[p] for p in self.params)]]
        for t in rows:
            s = self._stats(t)
            cells.append([t.trial_id, self.state(t), f"{s.get('epoch') or 0}/{self.full_epochs}", _num(s.get("last")),
                          _num(s.get("best")), *(fmt_value(lookup(t.config, p)) for p in self.params)])
        widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
        right = {2, 3, 4}   # epoch, last, best: numbers, right-aligned
        lines = [head]
        if rows:
            lines += ["  " + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                                       for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in cells]
        if more:
            lines.append(f"  ... and {more} more")
        lines += self._notes.values()
        lines.append("  " + self._best_line(trials))
        return lines

    def print_table(self, trials: list) -> None:
        print("\n".join(self.table(trials)), flush=True)
        self._last_print, self._changed = time.monotonic(), False
        self._recent, self._notes = [], {}

    def summary(self, trials: list) -> str:
        n = self.counts(trials)
        unfinished = n["running"] + n["pending"]
        by = f" by {experiments.stopped_by()}" if experiments.stopped_by() else ""
        verb = f"stopped{by} with {unfinished} trials unfinished" if unfinished else "finished"
        best = self._best(trials)
        tail = ""
        if best is not None:
            s = self._stats(best)
            at = f", epoch {s['epoch']}" if s.get("epoch") is not None else ""
            tail = f"; best {self.metric} {s['last']:.4f} (trial {best.trial_id}{at})"
        return (f"search {self.name} {verb} after {fmt_time(time.monotonic() - self._start)}: "
                f"{n['terminated']} terminated, {n['pruned']} pruned by ASHA, {n['errored']} errored{tail}")
