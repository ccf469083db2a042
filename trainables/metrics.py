"""Metric names, defined once and shared by the trainer, the Tune trainable and MLflow."""
from __future__ import annotations

from typing import Any

LOSS_SUP = "train/loss_sup"
ERR_SUP = "train/error_sup"
LOSS_CONS = "train/loss_cons"
CONF_RATE = "train/conf_rate"
LOSS_MIX = "train/loss_mix"
MIX_CONF_RATE = "train/mix_conf_rate"
LR = "train/lr"
IMAGES_PER_S = "train/images_per_s"
STEPS_PER_S = "train/steps_per_s"
EPOCH = "epoch"
# Where an epoch's wall time went: its steps, the evaluation, writing the checkpoint; and, in the epoch that
# ran it, the first step (compilation, cuDNN tuning, CUDA-graph capture) and the wait for another trial's.
TRAIN_S = "time/train_s"
EVAL_S = "time/eval_s"
CHECKPOINT_S = "time/checkpoint_s"
FIRST_STEP_S = "time/first_step_s"
COMPILE_WAIT_S = "time/compile_wait_s"
TURN_WAIT_S = "time/gpu_turn_wait_s"   # trials packed on one GPU: waiting for the turn, part of train_s
STEP = "step"


def eval_key(split: str, what: str, model: str) -> str:
    """e.g. eval_key("val", "error", "teacher") -> "val/error_teacher"."""
    return f"{split}/{what}_{model}"


def eval_metrics(split: str, model: str, scores: Any) -> dict[str, float]:
    """An evaluation's metrics (``step.Scores``): error, loss and, where measured, top-5 error ("val/error5_teacher")."""
    out = {eval_key(split, "error", model): scores.error, eval_key(split, "loss", model): scores.loss}
    if scores.error5 is not None:
        out[eval_key(split, "error5", model)] = scores.error5
    return out


VAL_ERROR_TEACHER = eval_key("val", "error", "teacher")   # the search objective
VAL_ERROR_STUDENT = eval_key("val", "error", "student")


def mean_of_last(metric: str, epochs: int) -> str:
    """The name of ``metric`` averaged over the last ``epochs`` epochs, e.g. "val/error_teacher_mean6" (a search's
    objective less noisy than the last epoch's value: ``SearchSettings.mean_of_last``); ``metric`` itself for 1."""
    return metric if epochs == 1 else f"{metric}_mean{epochs}"


def window_mean(history: list[dict[str, float]], metric: str, epochs: int) -> float:
    """``metric`` averaged over the last ``epochs`` rows of ``history`` (one row an epoch; fewer at the start)."""
    values = [row[metric] for row in history[-epochs:]]
    return sum(values) / len(values)
