"""Render a grid of masks (or images) as a PNG, with PIL only."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw


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
