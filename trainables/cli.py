"""The ``cowtune`` command line: train one config, score a trained run, draw masks, list what exists."""
from __future__ import annotations

import argparse
import errno
import hashlib
import json
import math
import sys
from pathlib import Path

import yaml

from trainables.validation import (CheckpointWriteError, ConfigError, RunOutOfMemory, TrainingDiverged, writable_file,
                                   writable_folder)


def _cmd_train(args: argparse.Namespace) -> int:
    from trainables.presets import load_config
    from trainables.trainer import check_names, fit

    if args.out is not None and not args.out.strip():
        raise ConfigError(f"--out must name a folder, got {args.out!r} (leave it out for runs/<config>-...)")
    cfg = load_config(args.config, args.set)
    out = Path(args.out).expanduser() if args.out else default_out(args.config, cfg.method, cfg.seed, args.set)
    print(f"cowtune train: {cfg.method} on {cfg.data.dataset} ({cfg.data.n_labeled} labels), output {out}")
    if args.dry_run:
        check_names(cfg)   # what fit() checks first, for a run that stops here
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return 0
    writable_folder(out, "--out", create=False)   # before the data is read: a file in the way is named, not a traceback
    try:
        result = fit(cfg, out, restart=args.restart, lock=True)   # a second run into --out is refused, naming this
    except (CheckpointWriteError, OSError) as exc:
        raise _no_space(exc, out) or exc
    print(json.dumps({k: v for k, v in result["final"].items() if "/" in k}, indent=2))
    best = result.get("best") or {}
    key = next((k for k in best if k != "epoch"), None)
    if key is not None:
        print(f"best epoch {int(best['epoch'])}: {key} {100 * best[key]:.2f}% (the result is the last epoch's)")
    print(f"done: results in {out}/result.json, checkpoint {out}/checkpoint.pt")
    return 0


def default_out(config: str, method: str, seed: int, overrides: list[str]) -> Path:
    """runs/<config>-<method>-seed<N>, and -<8 hex digits of the --set items, in order> when there are any: two
    runs of one config with other overrides do not share a folder by default (the same command resumes its own)."""
    name = f"{Path(config).stem}-{method}-seed{seed}"
    if overrides:
        name += "-" + hashlib.sha256("\n".join(overrides).encode()).hexdigest()[:8]
    return Path("runs") / name


def _no_space(exc: BaseException, out: Path) -> CheckpointWriteError | None:
    """A full disk (or quota) behind ``exc``, said so, or None. PyTorch's zip writer reports the failed write as
    "unexpected pos N vs M", the OSError it met only its context."""
    from trainables.trainer import CHECKPOINT

    cause: BaseException | None = exc
    while cause is not None and not (isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return None
    ckpt = out / CHECKPOINT
    what = (f"the checkpoint {ckpt}" if isinstance(exc, CheckpointWriteError) else
            cause.filename if cause.filename else "the run's files")
    kept = f"the last checkpoint, {ckpt}, is intact" if ckpt.exists() else "no checkpoint was written yet"
    return CheckpointWriteError(f"{cause.strerror.lower()} for --out {out} (writing {what}); {kept}: free space "
                                "and run the same command to resume")


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from trainables import checkpoints
    from trainables.evaluate import evaluate_checkpoint

    if args.json and not Path(args.json).expanduser().parent.is_dir():   # before the compute, not after it
        raise ConfigError(f"--json must be a file in an existing folder, got {args.json!r}")
    json_out = writable_file(args.json, "--json") if args.json else None   # a folder, a full disk: named now
    result = evaluate_checkpoint(args.checkpoint, args.data, args.batch_size, args.device, args.train_data)
    if json_out is not None:
        try:
            checkpoints.write_text(json_out, json.dumps(result, indent=2) + "\n")
        except OSError as exc:   # the disk filled while scoring: the scores are above, the file is not half-written
            raise ConfigError(f"--json {args.json} could not be written ({exc.strerror}); the scores are printed "
                              "above") from None
        print(f"wrote {args.json}")
    return 0


def _range(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI, got {text!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise argparse.ArgumentTypeError(f"expected LO:HI of finite numbers, got {text!r}")
    return lo, hi


MASK_OPTIONS = {"cowmix.sigma_range": "--sigma", "cowmix.prop_range": "--p", "cutmix.scale_mode": "--box-mode",
                "cutmix.scale": "--box-scale"}


def _as_options(validate) -> None:
    """Run a regularizer's own checks, its fields named as the ``masks`` options that set them."""
    try:
        validate()
    except ConfigError as exc:
        text = str(exc)
        for field, option in MASK_OPTIONS.items():
            text = text.replace(f"{field} ", f"{option} ")
        raise ConfigError(text) from None


MAX_MASKS, MAX_MASK_SIZE = 1024, 1024   # a gallery of 1,024 32x32 masks is a 3,204 px square PNG
MAX_MASK_PIXELS = MAX_MASKS * 128 * 128   # 64 MiB of float masks; 1,024 of 128x128 make a 4,228 px square


def _cmd_masks(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from trainables.gallery import save_gallery
    from trainables.ssl.regularizers import CowMix, CutMix

    if not (1 <= args.n <= MAX_MASKS and 2 <= args.size <= MAX_MASK_SIZE):
        raise ConfigError(f"-n must be 1..{MAX_MASKS} and --size 2..{MAX_MASK_SIZE}, got n={args.n}, size={args.size}")
    if args.n * args.size ** 2 > MAX_MASK_PIXELS:
        raise ConfigError(f"-n masks of --size px must hold at most {MAX_MASK_PIXELS:,} pixels in all (e.g. "
                          f"{MAX_MASKS} of 128x128, 16 of 1024x1024), got {args.n} of {args.size}x{args.size}")
    if args.kind == "cow":
        _as_options(lambda: CowMix(sigma_range=args.sigma, prop_range=args.p))  # the ranges, named as options
    else:
        _as_options(lambda: CutMix(scale_mode=args.box_mode, scale=args.box_scale))
    for path, option in ((args.out, "--out"), (args.npy, "--npy")):
        if path:
            writable_file(path, option)   # before the masks are drawn: a file in the way is named, not a traceback
    gen = torch.Generator().manual_seed(args.seed)
    if args.kind == "cow":
        from trainables.ssl.masks import cow_masks
        masks = cow_masks(args.n, (args.size, args.size), args.sigma, args.p, gen)
        title = f"CowMask sigma {args.sigma[0]:g}:{args.sigma[1]:g}, p {args.p[0]:g}:{args.p[1]:g}"
    else:
        from trainables.ssl.masks import box_masks
        masks = box_masks(args.n, (args.size, args.size), args.box_mode, args.box_scale, True, gen)
        title = f"box masks, {args.box_mode}"
    masks = masks[:, 0]
    save_gallery(masks, args.out, title=title)
    print(f"wrote {args.out}: {args.n} masks of {args.size}x{args.size}, mean proportion of ones "
          f"{masks.mean().item():.3f} (per-mask {masks.mean((1, 2)).min().item():.2f}..{masks.mean((1, 2)).max().item():.2f})")
    if args.npy:
        np.save(args.npy, masks.to(torch.uint8).numpy())
        print(f"wrote {args.npy}: array of shape {tuple(masks.shape)}, values 0/1")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from trainables.data import DATASETS
    from trainables.models import list_models
    from trainables.presets import list_presets
    from trainables.ssl.regularizers import REGULARIZERS

    print("presets:      " + ", ".join(list_presets()))
    print("models:       " + ", ".join(list_models()))
    print("datasets:     " + ", ".join(sorted(DATASETS)))
    print("regularizers: " + ", ".join(f"{n} ({c.kind})" for n, c in REGULARIZERS.items()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cowtune", description="CowMask semi-supervised training and search.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train one config on one device (GPU when present)")
    train.add_argument("config", help="a YAML file or a shipped preset name (see `cowtune list`)")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a field, e.g. --set train.epochs=10 --set mix.sigma_range=4:16")
    train.add_argument("--out", help="output folder (checkpoint, metrics); default runs/<config>-<method>-seed<N>, "
                       "with -<a hash of the --set items> when there are any")
    train.add_argument("--restart", action="store_true", help="ignore an existing checkpoint in --out")
    train.add_argument("--dry-run", action="store_true", help="print the resolved config and stop")
    train.set_defaults(func=_cmd_train)

    evaluate = sub.add_parser(
        "evaluate", help="score a trained run's teacher and student on a folder or .zip of labelled images",
        description="Score a run's teacher and student (top-1 error, mean cross-entropy) on labelled images, "
                    "prepared as the run evaluated its own: its class order, normalisation and resize or crop.",
        epilog="DIR layouts: <class>/<image> (every image is scored), or train/ and test/ (or val/) each holding "
               "<class>/<image> (only test/ is scored, else val/, else train/), as a folder or a .zip; a folder "
               "wrapping the tree is skipped. Class folders must be named as the training's classes (a subset is "
               "fine). Example: cowtune evaluate --checkpoint runs/fast-cowmix-seed0 --data cifar10_test.zip")
    evaluate.add_argument("--checkpoint", required=True, metavar="CKPT",
                          help="a run's checkpoint.pt, or the run folder holding it")
    evaluate.add_argument("--data", required=True, metavar="DIR", help="a folder or .zip of labelled images (below)")
    evaluate.add_argument("--batch-size", type=int, metavar="N", help="images per batch (default: the run's "
                          "train.eval_batch_size)")
    evaluate.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                          help="where to run the models (default auto: a GPU when there is one)")
    evaluate.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    evaluate.add_argument("--train-data", metavar="PATH",
                          help="only for an ImageFolder run whose checkpoint predates recorded class names and "
                               "normalisation: its training tree or .zip, to recompute them (default: its data.root)")
    evaluate.set_defaults(func=_cmd_evaluate)

    masks = sub.add_parser("masks", help="write a gallery PNG (and optionally .npy) of masks")
    masks.add_argument("--kind", choices=("cow", "box"), default="cow", help="CowMask, or CutMix's boxes (default cow)")
    masks.add_argument("--sigma", type=_range, default=(4.0, 16.0), metavar="LO:HI",
                       help="cow: the noise's Gaussian smoothing scale in pixels, drawn log-uniform (default 4:16)")
    masks.add_argument("--p", type=_range, default=(0.2, 0.8), metavar="LO:HI",
                       help="cow: the proportion of ones in each mask, drawn uniform (default 0.2:0.8)")
    masks.add_argument("--box-mode", default="random_area", choices=("fixed", "random_area", "random_size"),
                       help="box: how each box's size is drawn (default random_area)")
    masks.add_argument("--box-scale", type=float, default=0.25,
                       help="box: the area fraction for 'fixed' (default 0.25)")
    masks.add_argument("-n", type=int, default=32, help=f"how many masks (default 32, at most {MAX_MASKS})")
    masks.add_argument("--size", type=int, default=32,
                       help=f"mask height and width in pixels (default 32, at most {MAX_MASK_SIZE})")
    masks.add_argument("--seed", type=int, default=0, help="random seed: the same seed draws the same masks")
    masks.add_argument("--out", required=True, help="PNG file")
    masks.add_argument("--npy", help="also save the masks as an (N, H, W) uint8 array of 0/1")
    masks.set_defaults(func=_cmd_masks)

    lst = sub.add_parser("list", help="list presets, models, datasets and regularizers")
    lst.set_defaults(func=_cmd_list)
    from trainables.search.cli import add_search_commands
    add_search_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"cowtune: error: {exc}", file=sys.stderr)
        return 2
    except (CheckpointWriteError, TrainingDiverged, RunOutOfMemory) as exc:   # the last checkpoint is kept
        print(f"cowtune: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("cowtune: interrupted; the last epoch checkpoint is kept, run the same command to resume",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
