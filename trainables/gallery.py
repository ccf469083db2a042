"""Render a grid of masks (or images) as a PNG, with PIL only; a run config's masks as such a grid."""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image, ImageDraw

from trainables.ssl.masks import box_masks, cow_masks

if TYPE_CHECKING:
    from trainables.config import TrainConfig


def save_gallery(masks: torch.Tensor, path: str | Path, title: str = "", scale: int | None = None) -> Path:
    """Write (N, H, W) values in [0, 1] as a grid: white = 1, black = 0, grey gutters.

    Returns the path written.
    """
    masks = masks.detach().float().cpu()
    n, h, w = masks.shape
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    scale = scale or max(1, 96 // max(h, w))
    gap, top = 4, (18 if title else 0)
    canvas = np.full((top + rows * (h * scale + gap) + gap, cols * (w * scale + gap) + gap), 128, np.uint8)
    tiles = (masks.clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    for i in range(n):
        r, c = divmod(i, cols)
        tile = np.kron(tiles[i], np.ones((scale, scale), np.uint8))
        y, x = top + gap + r * (h * scale + gap), gap + c * (w * scale + gap)
        canvas[y:y + h * scale, x:x + w * scale] = tile
    img = Image.fromarray(canvas, mode="L")
    if title:
        ImageDraw.Draw(img).text((gap, 3), title, fill=255)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path


def config_gallery(cfg: TrainConfig, size: tuple[int, int], path: Path) -> Path | None:
    """16 masks of the config's mixing (else erasure) regularizer, seeded by the run seed; None if it has none."""
    reg = next((p.regularizer for p in (cfg.mix, cfg.perturb) if p is not None), None)
    gen = torch.Generator().manual_seed(cfg.seed)
    if hasattr(reg, "sigma_range"):
        masks = cow_masks(16, size, reg.sigma_range, reg.prop_range, gen)
        title = f"{reg.name} sigma {reg.sigma_range[0]:.1f}:{reg.sigma_range[1]:.1f} p {reg.prop_range[0]:.2f}:{reg.prop_range[1]:.2f}"
    elif hasattr(reg, "scale_mode"):
        masks, title = box_masks(16, size, reg.scale_mode, reg.scale, reg.random_aspect, gen), f"{reg.name} boxes"
    else:
        return None
    return save_gallery(masks[:, 0], path, title=title)
