"""What the trainer compiles its models with (``trainables.step``): Inductor's combo kernels where they were
measured to pay, and no buffer reuse for a student whose weight gradients run on a side stream."""
from __future__ import annotations

import pytest
import torch

from trainables.config import TrainConfig
from trainables.fast.compile_options import COMBO_KERNEL_MODELS, combo_kernels_wanted, inductor_options
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


def test_dependent_launch_by_model_and_by_config():
    """Programmatic dependent launch (Inductor's triton.enable_pdl) where it was measured to pay, WRN-28-2; not the
    shake-shake model, where it measured slower; ``train.dependent_launch`` overrides either, a bad one is refused;
    on a GPU it is an option of the models' own compile (so in the first-compile key), on the CPU absent."""
    import torch._inductor.config as inductor

    from trainables.fast.compile_options import DEPENDENT_LAUNCH_MODELS, dependent_launch_wanted

    def with_pdl(model: str, on=None) -> TrainConfig:
        return TrainConfig.from_dict({"model": model, "train": {"dependent_launch": on}})

    assert dependent_launch_wanted(with_pdl("wrn28_2")) and "wrn28_2" in DEPENDENT_LAUNCH_MODELS
    assert not dependent_launch_wanted(with_pdl("wrn26_6_shakeshake"))
    assert not dependent_launch_wanted(with_pdl("wrn28_2", False))
    assert dependent_launch_wanted(with_pdl("wrn26_6_shakeshake", True))
    with pytest.raises(ConfigError, match="dependent_launch"):
        with_pdl("wrn28_2", 1)
    assert inductor_options("default", CUDA, False, dependent_launch=True)["triton.enable_pdl"] is True
    assert inductor_options("default", CUDA, False)["triton.enable_pdl"] is False
    assert "triton.enable_pdl" not in inductor_options("default", CPU, False, dependent_launch=True)
    assert isinstance(inductor.triton.enable_pdl, bool)   # the option's name in the installed PyTorch


def test_a_combo_setting_that_is_not_a_bool_is_refused():
    with pytest.raises(ConfigError, match="combo_kernels"):
        cfg("wrn28_2", "yes")


def test_kernels_tuned_unless_deterministic_or_in_a_search():
    """Coordinate-descent tuning measures block sizes, so a deterministic run goes without; a search's trials turn
    it off where their config leaves it open (the tuning costs the first compile, which every trial waits for,
    more than a trial gains), in the worker process, not in the config: a promoted trial's config tunes."""
    import search_spaces.cifar10_cowmix as cowmix
    from trainables.fast.compile_options import tune_kernels_by_default, tune_kernels_wanted
    from trainables.search.trial import train_trial

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
        assert trial["train"]["fast"]["tune_kernels"] is None
    finally:
        tune_kernels_by_default(True)
    with pytest.raises(ConfigError, match="tune_kernels"):
        with_train(tune_kernels="yes")


def test_reads_threshold_by_model_and_by_config():
    """The shake-shake models get Inductor's realize_reads_threshold 4 (the gradient down their residual chain is then
    stored every other block, not re-read by every kernel of four), the others the trainer's global 8;
    ``train.realize_reads_threshold`` overrides either, and a bad one is refused."""
    from trainables.fast.compile_options import REALIZE_READS_BY_MODEL, realize_reads_wanted

    def with_reads(model: str, reads=None) -> TrainConfig:
        return TrainConfig.from_dict({"model": model, "train": {"realize_reads_threshold": reads}})

    assert {"wrn26_6_shakeshake", "wrn26_2_shakeshake", "wrn20_6_shakeshake"} <= set(REALIZE_READS_BY_MODEL)
    assert realize_reads_wanted(with_reads("wrn26_6_shakeshake")) == 4
    assert realize_reads_wanted(with_reads("wrn28_2")) is None
    assert realize_reads_wanted(with_reads("wrn26_6_shakeshake", 8)) == 8
    assert realize_reads_wanted(with_reads("wrn28_2", 3)) == 3
    for bad in (0, "4"):
        with pytest.raises(ConfigError, match="realize_reads_threshold"):
            with_reads("wrn28_2", bad)


def test_the_models_reads_threshold_reaches_inductor_in_forward_and_backward(monkeypatch):
    """The threshold is an option of the student's own torch.compile call: Inductor lowers both its forward and its
    backward graph under it while the trainer's global setting stays 8 for every other compile; and it is part of the
    first-compile lock's key, so kernels compiled under another threshold are not taken for these."""
    import torch._dynamo
    import torch._functorch.config as functorch
    import torch._inductor.config as inductor
    from torch._inductor.graph import GraphLowering

    from trainables.data import Batch
    from trainables.fast import switch
    from trainables.fast.stored_grad import register_lowering
    from trainables.fast.model_swaps import speed_up_model
    from trainables.trainer import build_runner

    seen: list[tuple[bool, int]] = []
    lower = GraphLowering.__init__

    def spy(self, *args, **kwargs):
        seen.append((bool(kwargs.get("is_backward", False)), inductor.realize_reads_threshold))
        lower(self, *args, **kwargs)

    monkeypatch.setattr(GraphLowering, "__init__", spy)
    registered = []   # the store's lowering, registered before compiling (the shake-shake blocks' input gradients)
    monkeypatch.setattr(switch, "register_store_lowering", lambda: registered.append(True) or register_lowering())
    cfg = TrainConfig.from_dict({"model": "cnn_tiny", "train": {"compile": True, "realize_reads_threshold": 3}})
    custom_functions = {name: getattr(functorch, name) for name in ("autograd_cache_allow_custom_autograd_functions",)
                        if hasattr(functorch, name)}   # set by the runner; absent in older PyTorch
    # config.patch restores what the runner sets (monkeypatch would delete a config module's entries on undo);
    # no cache: a cached graph would not be lowered again
    with inductor.patch(realize_reads_threshold=inductor.realize_reads_threshold, fx_graph_cache=False), \
            functorch.patch(enable_autograd_cache=False, **custom_functions), \
            torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit):
        runner = build_runner(cfg, 10, CPU)
        assert inductor.realize_reads_threshold == 8 and registered == [True]
        assert runner.fast.inductor_options["student"]["realize_reads_threshold"] == 3
        torch._dynamo.reset()
        try:
            runner.fast.kernels.student(torch.randn(2, 3, 32, 32)).sum().backward()
        finally:
            torch._dynamo.reset()
    assert (False, 3) in seen and (True, 3) in seen and all(reads == 3 for _, reads in seen), seen
    x = torch.zeros(2, 3, 32, 32)
    batch = Batch(x, torch.zeros(2, dtype=torch.long), x, x)
    compile_key = switch.compile_key
    key = compile_key(runner, batch)
    runner.fast.inductor_options["student"]["realize_reads_threshold"] = 8
    assert compile_key(runner, batch) != key
    key = compile_key(runner, batch)
    speed_up_model(runner.student, fuse_relu=False)   # a batch-norm switch: the traced graph differs
    assert compile_key(runner, batch) != key


def test_every_switch_of_the_fast_blocks_is_in_the_compile_key():
    """The first-compile lock's key reads the student's fast blocks' switches (``model_switches``), each of them: a
    switch left out would let a step compiled with it on take kernels compiled with it off."""
    import dataclasses

    from trainables.data import Batch
    from trainables.fast.model_swaps import BatchNormSwitches, ShakeShakeSwitches, speed_up_model
    from trainables.fast.switch import compile_key
    from trainables.trainer import build_runner

    cfg = TrainConfig.from_dict({"model": "wrn26_2_shakeshake", "train": {"compile": False}})
    runner = build_runner(cfg, 10, CPU)
    x = torch.zeros(2, 3, 32, 32)
    batch = Batch(x, torch.zeros(2, dtype=torch.long), x, x)
    keys = {compile_key(runner, batch)}
    fields = (*dataclasses.fields(ShakeShakeSwitches), *dataclasses.fields(BatchNormSwitches))
    for field in fields:
        speed_up_model(runner.student, **{field.name: False})
        keys.add(compile_key(runner, batch))
    assert len(keys) == 1 + len(fields)


def test_every_graph_switch_of_segmented_batch_norm_is_in_the_compile_key():
    """As above, for the batch norm's class switches; ``one_pass_eager`` (tests: the one-pass function when not
    compiling) is the one that changes no compiled graph."""
    import dataclasses

    from trainables.fast.model_swaps import BatchNormSwitches
    from trainables.models.segmented_bn import SegmentedBatchNorm2d

    switches = {name for name, value in vars(SegmentedBatchNorm2d).items() if isinstance(value, bool)}
    assert switches - {"one_pass_eager"} == {f.name for f in dataclasses.fields(BatchNormSwitches)}   # set per layer


def test_every_fast_switch_is_in_the_compile_key():
    """As above, for the fast path's switches (``FastSwitches``: which layers the row kernels take, and whether a
    shake-shake block's first convolutions are stacked; the EMA compiled or not; the Inductor options; the streams
    and the update's parts): each, set away from its default when the runner is built, gives a key of its own, and
    the defaults the key of a runner built without switches."""
    import dataclasses

    from trainables.data import Batch
    from trainables.fast.switch import FastSwitches, compile_key
    from trainables.trainer import build_runner

    cfg = TrainConfig.from_dict({"model": "wrn26_2_shakeshake", "train": {"compile": False}})
    x = torch.zeros(2, 3, 32, 32)
    batch = Batch(x, torch.zeros(2, dtype=torch.long), x, x)
    default = compile_key(build_runner(cfg, 10, CPU), batch)
    assert compile_key(build_runner(cfg, 10, CPU, switches=FastSwitches()), batch) == default
    keys = {default}
    fields = dataclasses.fields(FastSwitches)
    for field in fields:
        value = {"aggressive_fusion": True} if field.name == "extra_inductor_options" else not field.default
        keys.add(compile_key(build_runner(cfg, 10, CPU, switches=FastSwitches(**{field.name: value})), batch))
    assert len(keys) == 1 + len(fields)
