"""The trainer's step under several convolution settings, measured in one process, alternating.

Each variant's runner is built and captured first; then rounds of ``--steps`` steps go round the
variants in turn, so drift of the GPU's clocks and of the host falls on all of them alike:

    cudnn   train.fast.conv_kernels=cudnn: cuDNN for every convolution
    triton  train.fast.conv_kernels=triton: the row-streaming kernels (trainables/fast/conv_rows.py) for the
            ops and shapes in their table (conv_rows.CONFIGS), cuDNN for the rest
    sweep   as wgrad-stream (the trainer's defaults), with the table's configurations for the shapes in
            conv_rows_bench.py results (``--rows-json``) replaced by the best one per op and shape there, where
            it beat cuDNN (a shape the table lacks is added)
    wgrad-stream  as triton, with their weight gradients on a side stream (train.fast.wgrad_stream): the
            trainer's defaults
    aug-each-step  as wgrad-stream, with the batches augmented one step at a time
            (DeviceData.chunk_steps 1) instead of 8 steps at once
    eager-aug  as wgrad-stream, with the augmentation run eagerly (DeviceData.compiled false) instead of
            under torch.compile
    eager-ema  as wgrad-stream, with the teacher EMA run eagerly (FastSwitches.compile_ema false) instead of
            compiled
    no-priority  as wgrad-stream, with the step graph captured on a stream of the default priority
            (FastSwitches.capture_priority false) instead of a high-priority one
    one-update  as wgrad-stream, with the optimiser update and teacher EMA in one part after the weight-gradient
            stream's join (FastSwitches.update_in_parts false) instead of two around it
    untuned  as wgrad-stream, without Inductor's coordinate-descent tuning of the models' kernels
            (train.fast.tune_kernels false)
    no-combo, combo  as wgrad-stream, compiled without or with Inductor's combo kernels
            (train.fast.combo_kernels; by default on for the models in fast.compile_options.COMBO_KERNEL_MODELS)
    eager-masks-losses  as wgrad-stream, with the masks and mixing after their random draws, and the
            losses, run eagerly (train.fast.compile_masks_and_losses false) instead of compiled
    two-first-convs  as wgrad-stream, with a shake-shake block's two first convolutions run one by one
            (the fast block's one_first_conv false, trainables/fast/model_swaps.py) instead of as one
    biased-bn-convs  as wgrad-stream, with the shake-shake model's convolutions that feed a batch norm given a bias
            (the model built with bn_conv_bias true), as in the reference
    reference-convs  both of the above
    unfolded-teacher  as wgrad-stream, with the shake-shake teacher's batch norms computed as such in eval mode
            (fold_eval_bn false) instead of folded into its convolutions
    reads-N  as wgrad-stream, with the models compiled under Inductor's realize_reads_threshold N
            (train.fast.realize_reads_threshold; N = 2, 3, 4, 5, 6 or 8; 8 is the trainer's setting for every model but
            those in fast.compile_options.REALIZE_READS_BY_MODEL) instead of the model's own
    unstored-input-grads  as wgrad-stream, with the gradient at each shake-shake block's input recomputed in its
            readers (store_input_grad false) instead of stored once (trainables/fast/stored_grad.py)
    narrow-rows  as wgrad-stream, with the row kernels' switch narrowed to nn.Conv2d layers without bias
            (FastSwitches.same_and_biased false): the shake-shake WRN-26's stem and first block's 16 -> 96
            convolutions on cuDNN, the block's two first ones stacked
    inline-stats  as wgrad-stream, with the batch norms' running statistics and batch counts updated in small
            kernels of their own inside the stacked student call (defer_stats false, BN_SWITCHES) instead
            of after it in a few foreach kernels
    pdl, no-pdl  as wgrad-stream, with the models' Inductor kernels launched with or without programmatic
            dependent launch (train.fast.dependent_launch; by default on for the models in
            fast.compile_options.DEPENDENT_LAUNCH_MODELS)
    unpaired-inner-bn-relu  as wgrad-stream, with each shake-shake block's two inner batch norms and ReLUs as layers
            of their own, Inductor's backward, instead of one function over the stacked first convolution's output
            whose backward is our own kernels (paired_inner_bn_relu false; trainables/fast/bn_relu_pair.py)
    inductor:KEY=VALUE[;KEY=VALUE]  as wgrad-stream, with the student and the teacher compiled under these Inductor
            options as well, over the trainer's own (``torch._inductor.config`` names, values as Python literals
            of the option's type, no commas; FastSwitches.extra_inductor_options), for trying one of Inductor's
            settings before it becomes a field: ``inductor:aggressive_fusion=True``

A variant's fast-path switches (``variant_switches``: a ``trainables.fast.switch.FastSwitches``) are its runner's
own, passed to ``build_runner``; nothing is set on a class, so runners of several variants live side by side.

``--untuned`` turns Inductor's coordinate-descent tuning off in every variant (a shorter compile; the
shake-shake model's tuned compile takes minutes).

    python benchmarks/step_ab.py --variants cudnn,triton --rounds 3 --steps 300 --json out.json
    python benchmarks/step_ab.py --model wrn26_6_shakeshake --untuned --variants wgrad-stream,reference-convs
    python benchmarks/step_ab.py --device cpu --tiny        # smoke run

Prints steps/s per variant and round, and the median per variant.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_required import require_gpu  # noqa: E402
from throughput import load_images, make_config, time_steps  # noqa: E402

from trainables.data import DeviceData, make_splits  # noqa: E402
from trainables.fast import conv_rows  # noqa: E402
from trainables.fast.model_swaps import speed_up_model  # noqa: E402
from trainables.fast.switch import FastSwitches  # noqa: E402
from trainables.models import MODELS  # noqa: E402
from trainables.trainer import autotune_convolutions, build_runner  # noqa: E402

READS = {f"reads-{n}": n for n in (2, 3, 4, 5, 6, 8)}
VARIANTS = ("cudnn", "triton", "sweep", "wgrad-stream", "aug-each-step", "eager-aug", "eager-ema", "no-priority",
            "one-update", "untuned", "no-combo", "combo", "eager-masks-losses", "two-first-convs", "biased-bn-convs",
            "reference-convs", "unfolded-teacher", "unstored-input-grads", "narrow-rows", "inline-stats", "pdl",
            "no-pdl", "unpaired-inner-bn-relu", *READS)
INDUCTOR_PREFIX = "inductor:"
COMBO = {"no-combo": False, "combo": True}
DEPENDENT_LAUNCH = {"no-pdl": False, "pdl": True}
# variants that set some of the fast path's switches (FastSwitches fields) away from their defaults: those on in the
# trainer turned off; an experiment (a field off by default) adds its variant here, and to VARIANTS, turning it on.
# Once measured, each experiment either won its A/B run and is on by default, or was removed
# (docs/journal/2026-11-26.md to 2026-11-28.md)
FAST_SWITCHES: dict[str, dict[str, object]] = {"eager-ema": {"compile_ema": False},
                                               "one-update": {"update_in_parts": False},
                                               "no-priority": {"capture_priority": False},
                                               "narrow-rows": {"same_and_biased": False}}
# variants that turn off some of the fast shake-shake blocks' switches (trainables.fast.model_swaps.ShakeShakeSwitches,
# all on in the trainer): set on the built runner's student and teacher (``blocks_switched``)
BLOCK_SWITCHES = {"two-first-convs": {"one_first_conv": False}, "reference-convs": {"one_first_conv": False},
                  "unfolded-teacher": {"fold_eval_bn": False}, "unstored-input-grads": {"store_input_grad": False},
                  "unpaired-inner-bn-relu": {"paired_inner_bn_relu": False}}
# variants that turn off a fast-path setting of every batch norm (trainables.fast.model_swaps.BatchNormSwitches, all on
# in the trainer), any model: set on the built runner's student and teacher, as BLOCK_SWITCHES are
BN_SWITCHES = {"inline-stats": {"defer_stats": False}}
# variants whose shake-shake models are built in the reference's layout (``reference_layout``)
REFERENCE_LAYOUT = frozenset({"biased-bn-convs", "reference-convs"})
SHAKE_SHAKE = ("wrn26_6_shakeshake", "wrn26_2_shakeshake", "wrn20_6_shakeshake")


def variant_switches(variant: str | None) -> FastSwitches:
    """The fast-path switches of ``variant``'s runner: ``FAST_SWITCHES``' entry, and an ``inductor:`` variant's
    options (``inductor_options_of``); the defaults for any other variant (or None)."""
    if variant is None:
        return FastSwitches()
    return FastSwitches(**FAST_SWITCHES.get(variant, {}), extra_inductor_options=inductor_options_of(variant))


def inductor_options_of(variant: str) -> dict[str, object]:
    """The extra Inductor options an ``inductor:KEY=VALUE[;KEY=VALUE]`` variant names ({} for any other variant);
    a ValueError naming the part that is not one of this PyTorch's Inductor options with a literal value of its type,
    by torch.compile's own check of its options (which would otherwise fail only when that variant's runner is built,
    after the ones before it had compiled)."""
    if not variant.startswith(INDUCTOR_PREFIX):
        return {}
    import torch._inductor.config as inductor

    known = inductor.get_config_copy()
    options = {}
    for part in variant[len(INDUCTOR_PREFIX):].split(";"):
        key, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"{variant}: {part!r} is not KEY=VALUE")
        if key not in known:
            raise ValueError(f"{variant}: {key!r} is not an option of this PyTorch's Inductor")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"{variant}: {value!r} is not a Python literal") from None
    try:   # what torch.compile(options=...) runs on its options when it is called
        torch._TorchCompileInductorWrapper(None, options, False)
    except RuntimeError as e:
        raise ValueError(f"{variant}: {e}") from None
    return options


def build_variant_runner(cfg, num_classes: int, device: torch.device, variant: str | None,
                         switches: FastSwitches | None = None):
    """``build_runner``'s runner for ``variant``'s models, with its fast-path switches (``variant_switches``, or
    ``switches`` where given): built in the reference's layout where it asks (``REFERENCE_LAYOUT``), its fast blocks
    switched as it asks (``BLOCK_SWITCHES``)."""
    switches = variant_switches(variant) if switches is None else switches
    with reference_layout(variant in REFERENCE_LAYOUT):
        runner = build_runner(cfg, num_classes, device, switches=switches)
    blocks_switched(runner, variant)
    return runner


def blocks_switched(runner, variant: str | None):
    """The runner's student and teacher with their fast blocks' and batch norms' switches as ``variant`` asks
    (``BLOCK_SWITCHES``, ``BN_SWITCHES``; the others on): before its first step, which compiles and captures them.
    Another variant leaves them as built."""
    switches = BLOCK_SWITCHES.get(variant, BN_SWITCHES.get(variant))
    if switches is not None:
        for model in (runner.student, runner.teacher):
            speed_up_model(model, **switches)


@contextlib.contextmanager
def reference_layout(on: bool):
    """Within (if ``on``): the shake-shake models built in the reference's layout, a bias on each convolution that
    feeds a batch norm (their registered builders called with ``bn_conv_bias=True``); restored on leaving."""
    saved = {name: MODELS[name] for name in SHAKE_SHAKE}
    if on:
        MODELS.update({name: functools.partial(builder, bn_conv_bias=True) for name, builder in saved.items()})
    try:
        yield
    finally:
        MODELS.update(saved)


def rows_configs_from(paths: list[Path]) -> dict[tuple[str, int, int, int, int, int], dict]:
    """The best row configuration per (op, N, C, K, H, W) over conv_rows_bench.py JSONs, where it beat cuDNN."""
    best_of: dict[tuple[str, int, int, int, int, int], tuple[float, dict]] = {}
    for path in paths:
        for r in json.loads(path.read_text())["results"]:
            s = r.get("shape")
            for op, e in r.get("ops", {}).items():
                best, cudnn = e.get("best"), e.get("cudnn_us")
                key = (op, s["N"], s["C"], s["K"], s["H"], s["W"])
                if best and cudnn and best["us"] < cudnn and best["us"] < best_of.get(key, (cudnn, None))[0]:
                    best_of[key] = (best["us"], dict(best["config"]))
    return {key: cfg for key, (_, cfg) in best_of.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="wrn28_2")
    p.add_argument("--method", default="cowmix")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--variants", default="cudnn,triton")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rows-json", type=Path, nargs="*", default=None,
                   help="conv_rows_bench.py results to take the row configurations from")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--tiny", action="store_true", help="cnn_tiny, batch 16, a few steps, no compile")
    p.add_argument("--untuned", action="store_true", help="no coordinate-descent tuning in any variant")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS and not v.startswith(INDUCTOR_PREFIX):
            p.error(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}, {INDUCTOR_PREFIX}KEY=VALUE")
        try:
            inductor_options_of(v)
        except ValueError as e:
            p.error(str(e))
    if args.tiny:
        args.model, args.batch, args.steps, args.warmup, args.rounds = "cnn_tiny", 16, 2, 1, 1
        if any(v.startswith(INDUCTOR_PREFIX) for v in variants):
            p.error(f"{INDUCTOR_PREFIX} variants compile the step with their options, and --tiny does not compile")
    shake_only = [v for v in variants if v in BLOCK_SWITCHES or v in REFERENCE_LAYOUT]
    if shake_only and "shakeshake" not in args.model:
        p.error(f"{', '.join(shake_only)}: switches of the shake-shake models, not of {args.model}")
    device = torch.device(args.device)
    if device.type == "cuda":
        require_gpu("step_ab.py", "--device cpu --tiny is the CPU smoke run")
        autotune_convolutions()
    table = dict(conv_rows.CONFIGS)
    if "sweep" in variants and not args.rows_json:
        p.error("the sweep variant needs --rows-json")
    swept = rows_configs_from(args.rows_json) if args.rows_json else {}
    raw = load_images(None, 2000 if args.tiny else 20000)
    splits = make_splits(raw.train_labels, 0, 131, 100 if args.tiny else 1000, 0, raw.fingerprint)
    data = DeviceData(raw, splits, True, 4, device)
    data_each_step = copy.copy(data)   # the same images on the device, augmented one step at a time
    data_each_step.chunk_steps = 1
    data_eager_aug = copy.copy(data)
    data_eager_aug.compiled = False
    total = args.warmup + args.rounds * args.steps
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {"device": where, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "model": args.model, "method": args.method, "batch": args.batch,
              "table": {"/".join(map(str, k)): v for k, v in table.items()},
              "swept": {"/".join(map(str, k)): v for k, v in swept.items()}, "rounds": {}}
    print(f"# step A/B on {where}, torch {torch.__version__}, {args.model} {args.method}, "
          f"batch {args.batch}+{args.batch}", flush=True)
    runners = {}
    for v in variants:
        conv_rows.CONFIGS.clear()   # read when a runner's first steps run its kernels, before capture
        conv_rows.CONFIGS.update({**table, **swept} if v == "sweep" else table)
        cfg = make_config(args.model, args.method, args.batch, str(device), True, not args.tiny,
                          conv_kernels="cudnn" if v == "cudnn" else "triton", wgrad_stream=v not in ("cudnn", "triton"),
                          combo_kernels=COMBO.get(v), compile_masks_and_losses=v != "eager-masks-losses",
                          tune_kernels=v != "untuned" and not args.untuned, realize_reads_threshold=READS.get(v),
                          dependent_launch=DEPENDENT_LAUNCH.get(v),
                          cuda_graph="step" if device.type == "cuda" else "none")
        source = {"aug-each-step": data_each_step, "eager-aug": data_eager_aug}.get(v, data)
        batches = iter(source.train_batches(0, 0, args.batch, total, False))
        t0 = time.perf_counter()
        runner = build_variant_runner(cfg, len(raw.class_names), device, v)
        gen = runner.generator.manual_seed(0)
        for _ in range(args.warmup):   # compile, capture
            runner.step(next(batches), gen, 0.05, 0.97)
        runner.read_metrics()
        print(f"  {v}: built and captured in {time.perf_counter() - t0:.1f} s", flush=True)
        runners[v] = (runner, gen, batches)
        report["rounds"][v] = []
    conv_rows.CONFIGS.clear()
    conv_rows.CONFIGS.update(table)
    for r in range(args.rounds):
        for v in variants:
            runner, gen, batches = runners[v]
            sec = time_steps(runner, batches, gen, 0, args.steps, device)
            report["rounds"][v].append(1.0 / sec)
            print(f"  round {r} {v}: {1.0 / sec:.1f} steps/s", flush=True)
    report["median"] = {v: statistics.median(x) for v, x in report["rounds"].items()}
    for v, m in report["median"].items():
        print(f"{v:>6}: median {m:.1f} steps/s  rounds {', '.join(f'{x:.1f}' for x in report['rounds'][v])}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
