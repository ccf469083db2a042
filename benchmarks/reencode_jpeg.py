"""Re-encode an ImageFolder zip of JPEGs at a lower quality: the data's dose-response for the accuracy runs.

The CIFAR-10 zip we train on is JPEG at about quality 75 with 4:2:0 chroma; the paper used the lossless images.
Training the same run on harsher re-encodings of the same zip (quality 50, 30) shows how error grows with the
loss, and so roughly what lossless images would gain (docs/RESULTS.md):

    python benchmarks/reencode_jpeg.py .devdata/train.zip /tmp/train-q50.zip --quality 50

Each image is decoded and encoded again with Pillow (4:2:0 chroma, as the source); names and folders are kept.
"""
from __future__ import annotations

import argparse
import io
import zipfile

from PIL import Image


def reencode(src: str, dst: str, quality: int) -> int:
    n = 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.lower().endswith((".jpg", ".jpeg")):
                out = io.BytesIO()
                Image.open(io.BytesIO(data)).convert("RGB").save(out, "JPEG", quality=quality, subsampling=2)
                data, n = out.getvalue(), n + 1
            zout.writestr(info.filename, data)
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--quality", type=int, required=True, help="JPEG quality, 1-95")
    args = p.parse_args()
    if not 1 <= args.quality <= 95:
        raise SystemExit(f"--quality must be in 1..95, got {args.quality}")
    n = reencode(args.src, args.dst, args.quality)
    print(f"wrote {args.dst}: {n} images re-encoded at quality {args.quality}")


if __name__ == "__main__":
    main()
