"""A yardstick outside cowtune: supervised WRN-28-2 on a CIFAR-10 image zip with textbook PyTorch only.

Nothing here imports ``trainables``: the model is the common pre-activation WRN-28-2 of the semi-supervised
literature (PyTorch's padding=1 convolutions, 1x1 projection shortcuts), the data are decoded with PIL, padded
with ``F.pad(mode="reflect")``, randomly cropped and flipped, and the optimiser is ``torch.optim.SGD`` (Nesterov,
``weight_decay``), all on the schedule of ``cowtune train`` (learning rate x0.2 at 40% and x0.04 at 80% of the
epochs). If this script and ``cowtune train`` with ``mix=null perturb=null`` reach the same holdout error on the
same zip, the supervised part of the trainer (data, model, optimiser, schedule) is not where the gap to the paper
lies. Prints one line per epoch and writes them as JSON lines to ``--out``:

    python benchmarks/independent_supervised.py --data .devdata/train.zip --epochs 60 --out /tmp/ind.jsonl
"""
from __future__ import annotations

import argparse
import io
import json
import time
import zipfile

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image


def load_zip(path: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(N, 32, 32, 3) uint8 images and (N,) labels from a zip of class folders (labels: sorted folder names)."""
    with zipfile.ZipFile(path) as z:
        names = sorted(n for n in z.namelist() if n.lower().endswith((".jpg", ".jpeg", ".png")))
        classes = sorted({n.split("/")[-2] for n in names})
        images = np.stack([np.asarray(Image.open(io.BytesIO(z.read(n))).convert("RGB")) for n in names])
    labels = np.array([classes.index(n.split("/")[-2]) for n in names], dtype=np.int64)
    return images, labels, classes


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(cin), nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn2, self.conv2 = nn.BatchNorm2d(cout), nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.shortcut = None if (cin == cout and stride == 1) else nn.Conv2d(cin, cout, 1, stride, 0, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = F.relu(self.bn1(x))
        y = self.conv1(o)
        y = self.conv2(F.relu(self.bn2(y)))
        return y + (x if self.shortcut is None else self.shortcut(o))


class WRN(nn.Module):
    def __init__(self, depth: int = 28, width: int = 2, classes: int = 10):
        super().__init__()
        n = (depth - 4) // 6
        chans = [16, 16 * width, 32 * width, 64 * width]
        self.conv = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        layers = []
        for g in range(3):
            for i in range(n):
                layers.append(Block(chans[g] if i == 0 else chans[g + 1], chans[g + 1], (1 if g == 0 else 2) if i == 0 else 1))
        self.blocks = nn.Sequential(*layers)
        self.bn, self.fc = nn.BatchNorm2d(chans[3]), nn.Linear(chans[3], classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.Linear):
                nn.init.xavier_normal_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.blocks(self.conv(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--n-val", type=int, default=5000)
    p.add_argument("--n-train", type=int, default=0, help="labels used (0: all but the holdout)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--max-steps", type=int, default=0, help="stop early (a smoke test)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cudnn.benchmark = True
    t0 = time.time()
    images, labels, _ = load_zip(a.data)
    perm = np.random.default_rng(a.seed).permutation(len(labels))
    val, train = perm[:a.n_val], perm[a.n_val:]
    if a.n_train:
        train = train[:a.n_train]
    x = torch.from_numpy(images).to(dev).permute(0, 3, 1, 2).float().div_(255)
    mean, std = x[train].mean((0, 2, 3), keepdim=True), x[train].std((0, 2, 3), keepdim=True)
    x = (x - mean) / std
    y = torch.from_numpy(labels).to(dev)
    padded = F.pad(x, (4, 4, 4, 4), mode="reflect")
    train_t, val_t = torch.from_numpy(train).to(dev), torch.from_numpy(val).to(dev)
    print(f"{len(train)} train, {len(val)} holdout images decoded in {time.time() - t0:.0f}s on {dev}", flush=True)

    model = WRN().to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9, nesterov=True, weight_decay=a.wd)
    steps_per_epoch = len(train) // a.batch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 1.0 if s < 0.4 * a.epochs * steps_per_epoch else 0.2 if s < 0.8 * a.epochs * steps_per_epoch else 0.04)
    ar = torch.arange(32, device=dev)
    step, log = 0, open(a.out, "w")
    for epoch in range(1, a.epochs + 1):
        model.train()
        order = train_t[torch.randperm(len(train_t), device=dev)]
        t1, loss_sum = time.time(), torch.zeros((), device=dev)
        for i in range(steps_per_epoch):
            idx = order[i * a.batch:(i + 1) * a.batch]
            oy = torch.randint(0, 9, (len(idx),), device=dev)
            ox = torch.randint(0, 9, (len(idx),), device=dev)
            rows, cols = oy[:, None] + ar, ox[:, None] + ar
            xb = padded[idx[:, None, None, None], torch.arange(3, device=dev)[None, :, None, None],
                        rows[:, None, :, None], cols[:, None, None, :]]
            flip = torch.rand(len(idx), device=dev) < 0.5
            xb = torch.where(flip[:, None, None, None], xb.flip(3), xb).contiguous(memory_format=torch.channels_last)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.bf16):
                loss = F.cross_entropy(model(xb).float(), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_sum += loss.detach()
            step += 1
            if a.max_steps and step >= a.max_steps:
                break
        model.eval()
        wrong = 0
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.bf16):
            for j in range(0, len(val_t), 1000):
                v = val_t[j:j + 1000]
                wrong += (model(x[v].contiguous(memory_format=torch.channels_last)).argmax(1) != y[v]).sum().item()
        rec = {"epoch": epoch, "val_error": wrong / len(val_t), "train_loss": loss_sum.item() / max(1, i + 1),
               "lr": opt.param_groups[0]["lr"], "seconds": round(time.time() - t1, 2)}
        print(json.dumps(rec), flush=True)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if a.max_steps and step >= a.max_steps:
            break


if __name__ == "__main__":
    main()
