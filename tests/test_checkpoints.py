"""Checkpoints survive what happens to files: a truncated one falls back to the epoch before (and the resumed run
ends bit-for-bit where an undisturbed one does), an altered one is refused unread, and a full disk leaves the last
one intact. Real files, real faults (a truncation, an object no weights-only load admits, a file-size limit that
the kernel enforces)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainables import checkpoints
from trainables.trainer import fit
from trainables.validation import ConfigError

from test_trainer import tiny_config

ROOT = Path(__file__).resolve().parents[1]


class NotPlainData:   # what a weights-only load must refuse: an arbitrary class, as a tampered file would hold
    pass


def _weights(path: Path) -> dict:
    return torch.load(path, weights_only=True)["student"]


def test_a_truncated_checkpoint_resumes_from_the_epoch_before_and_ends_where_an_undisturbed_run_does(tmp_path):
    cfg = tiny_config("cowmix", epochs=3)
    fit(cfg, tmp_path / "straight", log=lambda s: None)
    fit(tiny_config("cowmix", epochs=3), tmp_path / "cut", log=lambda s: None)
    ckpt = tmp_path / "cut" / "checkpoint.pt"
    assert torch.load(checkpoints.previous(ckpt), weights_only=True)["epoch"] == 2
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2])           # a crash mid-copy, a disk that lost the tail
    lines = []
    result = fit(cfg, tmp_path / "cut", log=lines.append)
    assert any("cannot be read" in line and "resumed from the previous one (epoch 2)" in line for line in lines), lines
    assert (tmp_path / "cut" / "checkpoint.pt.damaged").stat().st_size == len(data) // 2
    assert result["final"]["epoch"] == 3
    straight, resumed = _weights(tmp_path / "straight" / "checkpoint.pt"), _weights(ckpt)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_a_checkpoint_holding_other_objects_is_refused_unread(tmp_path):
    fit(tiny_config("cowmix", epochs=1), tmp_path, log=lambda s: None)
    ckpt = tmp_path / "checkpoint.pt"
    state = torch.load(ckpt, weights_only=True)
    state["history"].append(NotPlainData())
    torch.save(state, ckpt)
    before = ckpt.read_bytes()
    with pytest.raises(ConfigError, match="holds objects other than tensors and plain data"):
        fit(tiny_config("cowmix", epochs=2), tmp_path, log=lambda s: None)
    assert ckpt.read_bytes() == before


def test_unreadable_checkpoint_without_a_previous_one_names_restart(tmp_path):
    fit(tiny_config("cowmix", epochs=1), tmp_path, log=lambda s: None)
    (tmp_path / "checkpoint.pt").write_bytes(b"PK\x03\x04 not really")
    with pytest.raises(ConfigError, match="cannot be read .* no previous checkpoint .* --restart"):
        fit(tiny_config("cowmix", epochs=2), tmp_path, log=lambda s: None)


FULL_DISK = """
import resource, signal, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_trainer import tiny_config
from trainables.trainer import fit

out = Path({out!r})
def report(epoch, metrics, path):
    if epoch == 1:   # from now on the kernel refuses to grow a file past half a checkpoint: the disk is full
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        limit = path.stat().st_size // 2
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
fit(tiny_config("cowmix", epochs=2), out, report=report, log=lambda s: None)
"""


def test_a_full_disk_leaves_the_last_checkpoint_intact(tmp_path):
    code = FULL_DISK.format(tests=str(ROOT / "tests"), out=str(tmp_path / "run"))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "could not write the checkpoint" in r.stderr and "is intact" in r.stderr, r.stderr[-2000:]
    ckpt = tmp_path / "run" / "checkpoint.pt"
    assert torch.load(ckpt, weights_only=True)["epoch"] == 1
    assert not list((tmp_path / "run").glob("*.tmp"))
    assert [json.loads(x)["epoch"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1]
