"""A search driver stopped by SIGTERM (``kill PID``, a scheduler's time limit) or Ctrl-C: one short summary, and the
same command resumes.

Ray's core installs a C++ SIGTERM handler in the driver at ``ray.init``: it prints "*** SIGTERM received at time=..."
with a stack dump and aborts (exit status 134), leaving the Ray experiment at its last periodic snapshot and the MLflow
parent run RUNNING. Ray Tune stops a run cleanly on SIGINT or SIGUSR1 (the trials stop, the experiment state is
saved, ``fit()`` returns), but then the driver cannot tell a stopped search from a finished one: it went on to
summarise, confirm and say "done".

``stop_cleanly`` (after ``ray.init``, for ``fit()``) takes SIGTERM and SIGINT in the driver and hands each to Tune's
clean stop (its SIGUSR1 handler, installed while ``fit()`` runs; Tune's own SIGINT handler is left out with
``TUNE_DISABLE_SIGINT_HANDLER``, so the driver knows which signal it was); a second signal, or one outside ``fit()``,
stops at once (KeyboardInterrupt). ``stopped_by`` then names the signal, or is None.
"""
from __future__ import annotations

import os
import signal
from typing import Any

TUNE_SIGINT_ENV = "TUNE_DISABLE_SIGINT_HANDLER"
_STOPPED: dict[str, str] = {}
NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C (SIGINT)"}


def _stop(signum: int, frame: Any) -> None:
    tune_stop = signal.getsignal(signal.SIGUSR1) if hasattr(signal, "SIGUSR1") else None
    if "by" in _STOPPED or not callable(tune_stop):   # a second signal, or no fit() running: stop now
        raise KeyboardInterrupt
    _STOPPED["by"] = NAMES.get(signum, f"signal {signum}")
    tune_stop(signum, frame)   # Tune: stop the trials, save the experiment state, return from fit()


def stop_cleanly() -> None:
    """SIGTERM and SIGINT to Tune's clean stop from now on (the main thread only; elsewhere nothing changes)."""
    _STOPPED.clear()
    os.environ[TUNE_SIGINT_ENV] = "1"
    for sig in NAMES:
        try:
            signal.signal(sig, _stop)
        except ValueError:   # not the main thread: signals cannot be taken here
            return


def stopped_by() -> str | None:
    return _STOPPED.get("by")
