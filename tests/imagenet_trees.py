"""Tiny generated trees of ImageNet's layout for the tests: ``root/train/<class>/*.JPEG`` and ``root/val/<class>/*``."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image


def jpeg_tree(root: Path, per_class: dict[str, int], val_per_class: int = 0, size: tuple[int, int] = (40, 30),
              seed: int = 0) -> Path:
    """JPEG files (quality 90) of smooth random colours, ``per_class[c]`` under ``train/c`` and ``val_per_class``
    under ``val/c``; sizes alternate landscape and portrait. Returns ``root``."""
    rng = np.random.default_rng(seed)
    for split, counts in (("train", per_class), ("val", {c: val_per_class for c in per_class})):
        for c, n in counts.items():
            folder = root / split / c
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                w, h = size if i % 2 == 0 else size[::-1]
                coarse = rng.integers(0, 256, (3, 4, 3), dtype=np.uint8)
                buf = io.BytesIO()
                Image.fromarray(coarse).resize((w, h), Image.BICUBIC).save(buf, "JPEG", quality=90)
                (folder / f"{c}_{i}.JPEG").write_bytes(buf.getvalue())
    return root
