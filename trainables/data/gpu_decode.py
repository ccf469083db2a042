"""Large-image augmentation as batched tensor ops on the training device: JPEG bytes read on the host, decoded by
``torchvision.io.decode_jpeg`` on the device (nvJPEG on a GPU, libjpeg on the CPU), then the reference's ImageNet
augmentation (arXiv:2003.12022 and its ``imagenet_data_source.py``; reference 4.2) on the decoded tensors.

* Inception crop: TF's ``sample_distorted_bounding_box`` with the whole image as the box, area (0.05, 1.0), aspect
  (0.75, 1.33) drawn uniformly, ``min_object_covered`` 0.1 (so no crop below 10% of the area survives), 100
  attempts, the whole image when none is valid (``CROP_*``, the PIL path's constants). Drawn for a whole batch at once (``crop_uniforms`` then
  ``inception_boxes``), from CPU generators, so the crops do not depend on the device.
* Bicubic resize to ``size`` with antialiasing (PIL's ``BICUBIC``, which the host path uses), per image.
* Horizontal flip, optional colour jitter (saturation, hue, contrast, brightness in a random order per image).
* Evaluation: the centre square of 0.875 x the short side, resized bicubically.

The PIL path (``trainables.data.loader``) implements the same rules one image at a time;
``tests/test_imagenet_pipeline.py`` checks the two against each other by their statistics.
"""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from trainables.data.image_files import _zip_handle, to_rgb
from trainables.data.loader import (EVAL_CROP, INCEPTION_ATTEMPTS, INCEPTION_MIN_COVERED, INCEPTION_RATIO,
                                    INCEPTION_SCALE)

if TYPE_CHECKING:
    from trainables.data.image_files import FileImages

# The rule's constants, shared with the PIL path: area 5..100%, aspect 0.75..1.33 (uniform), 100 attempts, >= 10%
CROP_AREA, CROP_ASPECT, CROP_ATTEMPTS, CROP_MIN_COVERED = (INCEPTION_SCALE, INCEPTION_RATIO, INCEPTION_ATTEMPTS,
                                                           INCEPTION_MIN_COVERED)
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


# ---------------------------------------------------------------------------------------------
# Bytes and decoding
# ---------------------------------------------------------------------------------------------

def read_bytes(images: "FileImages", i: int) -> bytes:
    """The undecoded bytes of image ``i`` of a folder tree or a .zip (one zip handle per process)."""
    name = str(images.names[i])
    if os.path.isdir(images.root):
        with open(os.path.join(images.root, name), "rb") as f:
            return f.read()
    return _zip_handle(images.root).read(name)


def jpeg_header(data: bytes) -> tuple[int, int, int] | None:
    """(width, height, colour components) from a JPEG's frame header, or None when ``data`` is not a JPEG."""
    if data[:3] != b"\xff\xd8\xff":
        return None
    pos, n = 2, len(data)
    while pos + 9 < n:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:          # fill byte
            pos += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            pos += 2
            continue
        length = int.from_bytes(data[pos + 2:pos + 4], "big")
        if marker in _SOF:
            height, width = (int.from_bytes(data[pos + 5:pos + 7], "big"), int.from_bytes(data[pos + 7:pos + 9], "big"))
            return width, height, data[pos + 9]
        pos += 2 + length
    return None


def _pil_decode(data: bytes) -> Tensor:
    import io

    from PIL import Image
    return torch.from_numpy(np.array(to_rgb(Image.open(io.BytesIO(data))), dtype=np.uint8)).permute(2, 0, 1)


class Decoder:
    """Bytes -> RGB uint8 (3, H, W) tensors on ``device``, a batch at a time.

    JPEGs with 1 or 3 components go to ``decode_jpeg`` on the device in one call; CMYK/YCCK JPEGs (4 components,
    which nvJPEG does not take) are decoded by libjpeg on the host, and anything else (PNG, a broken JPEG) by PIL
    on the host, then copied over. The first time a batch needs the host, one line on stderr says how many and why.
    """

    def __init__(self, device: torch.device, shown: str = ""):
        self.device, self.shown, self.warned = torch.device(device), shown, False

    def __call__(self, blobs: Sequence[bytes]) -> list[Tensor]:
        from torchvision.io import ImageReadMode, decode_jpeg

        out: list[Tensor | None] = [None] * len(blobs)
        fast = [i for i, b in enumerate(blobs) if (h := jpeg_header(b)) is not None and h[2] in (1, 3)]
        if fast:
            data = [torch.frombuffer(bytearray(blobs[i]), dtype=torch.uint8) for i in fast]
            try:
                decoded = decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device)
            except RuntimeError:   # one file the device decoder refuses (progressive on some versions, damaged)
                decoded = [None] * len(fast)
            for i, t in zip(fast, decoded):
                out[i] = t
        slow = [i for i, t in enumerate(out) if t is None]
        for i in slow:
            out[i] = self._host(blobs[i]).to(self.device, non_blocking=True)
        if slow and not self.warned:
            self.warned = True
            print(f"cowtune: {len(slow)} of {len(blobs)} images in a batch of {self.shown or 'the data'} are not "
                  f"baseline RGB or greyscale JPEGs: decoded on the host (libjpeg or PIL), the rest on {self.device}",
                  file=sys.stderr, flush=True)
        return out   # type: ignore[return-value]

    @staticmethod
    def _host(data: bytes) -> Tensor:
        from torchvision.io import ImageReadMode, decode_jpeg
        if data[:3] == b"\xff\xd8\xff":
            try:
                return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
            except RuntimeError:
                pass
        return _pil_decode(data)   # raises PIL's error for a file nothing can decode


# ---------------------------------------------------------------------------------------------
# Random parameters (CPU generators: the same crops on any device)
# ---------------------------------------------------------------------------------------------

def crop_uniforms(n: int, gen: torch.Generator) -> Tensor:
    """(n, CROP_ATTEMPTS, 4) float64 uniforms in [0, 1): aspect, height, top, left of every attempt."""
    return torch.rand((n, CROP_ATTEMPTS, 4), generator=gen, dtype=torch.float64)


def inception_boxes(sizes: Tensor, u: Tensor) -> Tensor:
    """TF's ``sample_distorted_bounding_box`` (whole-image box, ``CROP_*``), vectorised over images and attempts.

    Args:
        sizes: (n, 2) int64 (width, height). u: (n, A, 4) from ``crop_uniforms``.
    Returns:
        (n, 4) int64 (left, top, width, height): the first valid attempt, else the whole image.
    """
    w = sizes[:, 0:1].double()
    h = sizes[:, 1:2].double()                                            # (n, 1)
    ar = CROP_ASPECT[0] + u[..., 0] * (CROP_ASPECT[1] - CROP_ASPECT[0])    # (n, A)
    min_area, max_area = CROP_AREA[0] * w * h, CROP_AREA[1] * w * h
    height = torch.round(torch.sqrt(min_area / ar))
    max_h = torch.round(torch.sqrt(max_area / ar))
    too_wide = torch.round(max_h * ar) > w
    fit = torch.floor((w + 0.5 - 1e-7) / ar)
    fit = torch.where(torch.round(fit * ar) > w, fit - 1, fit)
    max_h = torch.minimum(torch.where(too_wide, fit, max_h), h)
    height = torch.minimum(height, max_h)
    height = height + torch.floor(u[..., 1] * (max_h - height + 1)).clamp(min=0)
    width = torch.round(height * ar)
    small = width * height < min_area
    height = torch.where(small, height + 1, height)
    width = torch.where(small, torch.round(height * ar), width)
    area = width * height
    ok = ((area >= min_area) & (area <= max_area) & (width <= w) & (height <= h) & (width > 0) & (height > 0)
          & (area >= CROP_MIN_COVERED * w * h))
    top = torch.floor(u[..., 2] * (h - height))
    left = torch.floor(u[..., 3] * (w - width))
    first = ok.double().argmax(1, keepdim=True)                           # (n, 1): first valid attempt
    pick = lambda t: t.gather(1, first).squeeze(1)
    found = ok.any(1)
    box = torch.stack([pick(left), pick(top), pick(width), pick(height)], 1)
    whole = torch.cat([torch.zeros_like(sizes), sizes], 1).double()
    return torch.where(found[:, None], box, whole).long()


def centre_boxes(sizes: Tensor) -> Tensor:
    """(n, 4) int64 (left, top, side, side): the centre square of ``EVAL_CROP`` x the short side."""
    side = torch.round(EVAL_CROP * sizes.min(1).values.double()).clamp(min=1)
    left = torch.round((sizes[:, 0] - side) / 2)
    top = torch.round((sizes[:, 1] - side) / 2)
    return torch.stack([left, top, side, side], 1).long()


def jitter_params(n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Colour-jitter factors (n, 4) float32 (saturation, hue, contrast, brightness) and each image's order
    (n, 4) int64, a random permutation of the four (``loader._colour_jitter``'s ranges)."""
    u = torch.rand((n, 4), generator=gen, dtype=torch.float64)
    lo = torch.tensor([0.7, -0.1, 0.7, 0.6], dtype=torch.float64)
    hi = torch.tensor([1.4, 0.1, 1.4, 1.4], dtype=torch.float64)
    order = torch.rand((n, 4), generator=gen).argsort(1)
    return (lo + u * (hi - lo)).float(), order


# ---------------------------------------------------------------------------------------------
# Tensor ops on the device
# ---------------------------------------------------------------------------------------------

def crop_resize(images: Sequence[Tensor], boxes: Tensor, size: int) -> Tensor:
    """Crop each uint8 (3, H, W) image to its box and resize it bicubically (antialiased, as PIL) to
    (size, size): -> float32 (n, 3, size, size) on the images' device, in 0..255, not yet rounded."""
    out = []
    for img, (left, top, cw, ch) in zip(images, boxes.tolist()):
        crop = img[:, top:top + ch, left:left + cw].unsqueeze(0).float()      # (1, 3, ch, cw)
        out.append(F.interpolate(crop, size=(size, size), mode="bicubic", antialias=True, align_corners=False))
    return torch.cat(out).clamp_(0, 255)


def flip_(x: Tensor, flips: Tensor) -> Tensor:
    """Mirror the images of x (n, 3, S, S) where ``flips`` (n,) bool is set."""
    flips = flips.to(x.device)
    return torch.where(flips[:, None, None, None], x.flip(3), x)


def _grey(x: Tensor) -> Tensor:
    return (0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3])     # (n, 1, S, S), ITU-R 601 as PIL


def _hue(x: Tensor, shift: Tensor) -> Tensor:
    """Rotate the hue of x (n, 3, S, S) in 0..255 by ``shift`` (n, 1, 1) turns, in HSV (as torchvision and PIL);
    back to RGB by the closed form f(m) = V - V S clamp(min(k, 4 - k), 0, 1), k = (m + 6 H) mod 6, m = 5, 3, 1."""
    r, g, b = x.unbind(1)
    maxc, minc = x.max(1).values, x.min(1).values
    delta = maxc - minc
    safe = torch.where(delta > 0, delta, torch.ones_like(delta))
    hue = torch.where(maxc == r, (g - b) / safe, torch.where(maxc == g, 2.0 + (b - r) / safe, 4.0 + (r - g) / safe))
    hue = torch.where(delta > 0, hue, torch.zeros_like(hue)) + 6.0 * shift      # in sixths of a turn
    chroma = delta                                                             # V S = max - min
    out = [maxc - chroma * torch.clamp(torch.minimum(k, 4.0 - k), 0.0, 1.0)
           for k in (torch.remainder(m + hue, 6.0) for m in (5.0, 3.0, 1.0))]
    return torch.stack(out, 1)


def colour_jitter(x: Tensor, factors: Tensor, order: Tensor) -> Tensor:
    """Per-image saturation, hue, contrast and brightness (``jitter_params``) in each image's own order, on
    x (n, 3, S, S) float in 0..255: at each of the four positions, each op runs once on the images whose order
    puts it there. ``order`` stays on the CPU, so choosing those images costs the device no sync."""
    f = factors.to(x.device)
    ops = [lambda y, k: (f[k, 0].view(-1, 1, 1, 1) * y + (1 - f[k, 0].view(-1, 1, 1, 1)) * _grey(y)),
           lambda y, k: _hue(y, f[k, 1].view(-1, 1, 1)),
           lambda y, k: (f[k, 2].view(-1, 1, 1, 1) * y
                         + (1 - f[k, 2].view(-1, 1, 1, 1)) * _grey(y).mean((1, 2, 3), keepdim=True)),
           lambda y, k: f[k, 3].view(-1, 1, 1, 1) * y]
    x = x.clone()
    for position in range(4):
        for op_id, op in enumerate(ops):
            rows = (order[:, position] == op_id).nonzero().flatten()       # on the CPU
            if len(rows):
                rows = rows.to(x.device, non_blocking=True)
                x[rows] = op(x[rows], rows).clamp_(0, 255)
    return x


def to_uint8(x: Tensor) -> Tensor:
    """float 0..255 -> uint8, rounded (as PIL stores its resampled pixels)."""
    return x.round_().clamp_(0, 255).to(torch.uint8)


def image_sizes(images: Sequence[Tensor]) -> Tensor:
    """(n, 2) int64 (width, height) of (3, H, W) tensors."""
    return torch.tensor([[int(t.shape[2]), int(t.shape[1])] for t in images], dtype=torch.int64)


def area_and_aspect(boxes: Tensor, sizes: Tensor) -> tuple[Tensor, Tensor]:
    """Each box's area fraction of its image and its aspect (width / height), float64 (n,)."""
    b, s = boxes.double(), sizes.double()
    return b[:, 2] * b[:, 3] / (s[:, 0] * s[:, 1]), b[:, 2] / b[:, 3]

