"""Checkpoints written by earlier layouts of a model, made loadable by the current one.

The shake-shake WRN's convolutions that feed a batch norm used to have a bias (the reference's layout); they
no longer do (``trainables.models.layers.BnFedConv2d``). Its model state loads as it is: ``ShakeShakeBlock`` folds each
bias into the batch norm's running mean. The optimiser's state does not: SGD keeps one momentum buffer per
parameter, numbered in parameter order, and the old numbering has the biases in it.
``upgrade_optimizer_state`` drops them and renumbers the rest, so a run checkpointed before the change resumes
after it.

A checkpoint's config may be older too: before 2026-12-03 the speed settings sat directly under ``train``
(``train.compile``, beside ``train.fast`` true or false); today they are the section ``train.fast``.
``trainables.config.upgrade_layout`` moves them, inside ``TrainConfig.from_dict``, so every stored config (a
checkpoint's, a run folder's, a search's store, a promoted YAML) reads the same way; it lives there and not here
because this module needs ``trainables.optim``, which needs the config.
"""
from __future__ import annotations

from torch import nn

from trainables.optim import is_kernel


def optimizer_parameter_names(model: nn.Module, params: list[str]) -> list[list[str]]:
    """``params`` (state-dict names of parameters, in ``model.modules()`` order; some may be gone from ``model``)
    in ``make_optimizer``'s two groups: kernels, then the rest. A name ``model`` lacks (a dropped bias) is in the
    second group."""
    groups: list[list[str]] = [[], []]
    for key in params:
        owner, _, name = key.rpartition(".")
        try:
            module = model.get_submodule(owner)
        except AttributeError:
            module = None
        groups[0 if module is not None and is_kernel(module, name) else 1].append(key)
    return groups


def upgrade_optimizer_state(state: dict, old_model_state: dict, model: nn.Module) -> dict:
    """``state`` (an optimiser's state dict saved beside ``old_model_state``) for an optimiser built by
    ``make_optimizer`` over ``model``: the entries of parameters ``model`` no longer has dropped and the rest
    renumbered. Returned as it is when nothing was dropped or it does not match the old layout (the
    optimiser's own check then says what is wrong)."""
    current = model.state_dict()
    buffers = {name for name, _ in model.named_buffers()}
    params = [k for k in old_model_state if k not in buffers]
    if all(k in current for k in params):
        return state
    old_groups = optimizer_parameter_names(model, params)
    if [len(g) for g in old_groups] != [len(g["params"]) for g in state["param_groups"]]:
        return state
    new_groups, renumber, index = [], {}, 0
    for names, group in zip(old_groups, state["param_groups"]):
        kept = []
        for name, old_id in zip(names, group["params"]):
            buffer = state["state"].get(old_id, {}).get("momentum_buffer")
            if buffer is not None and buffer.shape != old_model_state[name].shape:
                raise ValueError(f"the optimiser state does not follow its model state's parameter order: parameter "
                                 f"{old_id} ({name}, {tuple(old_model_state[name].shape)}) has a momentum buffer of "
                                 f"shape {tuple(buffer.shape)}")
            if name in current:
                renumber[old_id] = index
                kept.append(index)
                index += 1
        # (param_names, which newer optimisers may save, would name the dropped parameters too)
        new_groups.append({**{k: v for k, v in group.items() if k != "param_names"}, "params": kept})
    return {"state": {renumber[i]: v for i, v in state["state"].items() if i in renumber}, "param_groups": new_groups}
