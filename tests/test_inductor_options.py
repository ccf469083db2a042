"""What the trainer compiles its models with (``trainables.step``): Inductor's combo kernels where they were
measured to pay, and no buffer reuse for a student whose weight gradients run on a side stream."""
from __future__ import annotations

import pytest
import torch

from trainables.config import TrainConfig
from trainables.step import COMBO_KERNEL_MODELS, combo_kernels_wanted, inductor_options
from trainables.validation import ConfigError

CUDA, CPU = torch.device("cuda"), torch.device("cpu")   # device objects only: nothing runs on them


def cfg(model: str, combo=None) -> TrainConfig:
    return TrainConfig.from_dict({"model": model, "train": {"combo_kernels": combo}})


def test_combo_kernels_by_default_only_for_the_models_measured():
    assert combo_kernels_wanted(cfg("wrn28_2")) and "wrn28_2" in COMBO_KERNEL_MODELS
    assert not combo_kernels_wanted(cfg("wrn26_6_shakeshake"))   # measured slower there
    assert not combo_kernels_wanted(cfg("wrn28_2", False))
    assert combo_kernels_wanted(cfg("wrn26_6_shakeshake", True))


def test_options_on_a_gpu_and_on_the_cpu():
    on = inductor_options("default", CUDA, True)
    assert on["combo_kernels"] is True and "allow_buffer_reuse" not in on
    assert inductor_options("default", CUDA, False)["combo_kernels"] is False
    assert "combo_kernels" not in inductor_options("default", CPU, True)   # Inductor's CPU code has no use for it
    stream = inductor_options("max-autotune-no-cudagraphs", CUDA, True, wgrad_stream=True)
    assert stream["allow_buffer_reuse"] is False and stream["inplace_buffers"] is False
    assert stream["max_autotune"] is True   # the mode's own options are kept


def test_a_combo_setting_that_is_not_a_bool_is_refused():
    with pytest.raises(ConfigError, match="combo_kernels"):
        cfg("wrn28_2", "yes")


def test_kernels_tuned_unless_deterministic_or_in_a_search():
    """Coordinate-descent tuning measures block sizes, so a deterministic run goes without; a search's trials turn
    it off where their config leaves it open (the tuning costs the first compile, which every trial waits for,
    more than a trial gains), in the worker process, not in the config: a promoted trial's config tunes."""
    import search_spaces.cifar10_cowmix as cowmix
    from trainables.step import tune_kernels_by_default, tune_kernels_wanted
    from trainables.tune_trainable import train_trial

    def with_train(**train):
        return TrainConfig.from_dict({"model": "wrn28_2", "train": train})

    tune_kernels_by_default(True)
    try:
        assert tune_kernels_wanted(with_train()) and not tune_kernels_wanted(with_train(deterministic=True))
        assert not tune_kernels_wanted(with_train(tune_kernels=False))
        assert tune_kernels_wanted(with_train(tune_kernels=True, deterministic=True))
        trial = cowmix.BASE.to_dict()
        trial["data"].update(eval_split="test", n_val=0)   # refused right after the worker's defaults are set
        with pytest.raises(ConfigError, match="eval_split"):
            train_trial({**trial, "_cowtune": {"mode": "search"}})
        assert not tune_kernels_wanted(with_train()) and tune_kernels_wanted(with_train(tune_kernels=True))
        assert trial["train"].get("tune_kernels") is None
    finally:
        tune_kernels_by_default(True)
    with pytest.raises(ConfigError, match="tune_kernels"):
        with_train(tune_kernels="yes")


def test_shake_shake_models_compile_under_their_own_reads_threshold():
    """The shake-shake models' student and teacher are compiled with Inductor's realize_reads_threshold 4 (the
    gradient down their residual chain is then stored every other block, not re-read by every kernel of four), the
    others under the trainer's global 8; the threshold is part of the first-compile lock's key, so kernels compiled
    under another threshold are not taken for these."""
    import torch._inductor.config as inductor

    from trainables.data import Batch
    from trainables.step import REALIZE_READS_BY_MODEL
    from trainables.trainer import build_runner

    assert {"wrn26_6_shakeshake", "wrn26_2_shakeshake", "wrn20_6_shakeshake"} <= set(REALIZE_READS_BY_MODEL)
    saved = inductor.realize_reads_threshold
    try:
        def runner(model: str):   # torch.compile only wraps the models here: nothing compiles until a step runs
            cfg = TrainConfig.from_dict({"model": model, "train": {"compile": True}})
            return build_runner(cfg, 10, CPU)

        shake, wrn = runner("wrn26_2_shakeshake"), runner("wrn28_2")
        assert inductor.realize_reads_threshold == 8   # the trainer's global setting, for every other compile
        for name in ("student", "teacher"):
            assert shake.inductor_options[name]["realize_reads_threshold"] == 4
            assert "realize_reads_threshold" not in wrn.inductor_options[name]
        x = torch.zeros(2, 3, 32, 32)
        batch = Batch(x, torch.zeros(2, dtype=torch.long), x, x)
        key = shake.compile_key(batch)
        shake.inductor_options["student"]["realize_reads_threshold"] = 8
        assert shake.compile_key(batch) != key
    finally:
        inductor.realize_reads_threshold = saved
