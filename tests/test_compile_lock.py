"""The machine-wide first-compile lock: the first process compiles alone, the ones that waited go on together."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from trainables.compile_lock import LOCK_NAME, cache_folder, first_compile_lock, step_key

COMPILER = """
import sys, time
from trainables.compile_lock import first_compile_lock
with first_compile_lock(sys.argv[2], max_wait_s=float(sys.argv[3])) as info:
    print(f"in {time.time()} {info['waited_s']}", flush=True)
    time.sleep(float(sys.argv[1]))
"""


def _start(hold_s: float, cache: Path, key: str = "wrn", max_wait_s: float = 60.0) -> subprocess.Popen:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", COMPILER, str(hold_s), key, str(max_wait_s)], env=env, stdout=subprocess.PIPE, text=True)


def _entered(proc: subprocess.Popen) -> tuple[float, float]:
    word, at, waited = proc.stdout.readline().split()
    assert word == "in"
    return float(at), float(waited)


def test_the_lock_lives_in_inductors_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert cache_folder() == tmp_path / "inductor"
    key = step_key("torch", "wrn28_2", (256, 3, 32, 32))
    assert key == step_key("torch", "wrn28_2", (256, 3, 32, 32)) != step_key("torch", "wrn28_2", (128, 3, 32, 32))
    with first_compile_lock(key) as info:
        assert (tmp_path / "inductor" / LOCK_NAME).exists() and info["waited_s"] < 0.5
    assert (tmp_path / "inductor" / f"cowtune-compiled-{key}").exists()   # compiled once: later ones need no lock
    with first_compile_lock("other", enabled=False) as info:   # off: no wait, no marker
        assert info["waited_s"] == 0.0
    assert not (tmp_path / "inductor" / "cowtune-compiled-other").exists()


def test_waiters_start_together_once_the_first_compile_is_done(tmp_path):
    # (each process imports torch to find Inductor's cache folder: about 2 s before it asks for the lock)
    procs = [_start(5.0, tmp_path)]
    try:
        first_in, first_waited = _entered(procs[0])
        assert first_waited == 0.0
        procs += [_start(4.0, tmp_path), _start(4.0, tmp_path)]
        (a_in, a_waited), (b_in, b_waited) = _entered(procs[1]), _entered(procs[2])
        # both waited for the first one (it held the lock 5 s), then compiled at the same time
        assert a_in >= first_in + 4.9 and b_in >= first_in + 4.9
        assert a_waited > 0.3 and b_waited > 0.3
        assert abs(a_in - b_in) < 1.0
        # one that comes while the waiters compile joins them at once: nobody compiles alone then
        procs.append(_start(0.1, tmp_path, key="resnet"))
        late_in, late_waited = _entered(procs[3])
        assert late_waited < 0.5 and late_in < min(a_in, b_in) + 4.0
        # a step like the first one's, once it has compiled, needs no lock even while someone compiles another
        holder = _start(5.0, tmp_path, key="shake")
        procs.append(holder)
        shake_in, _ = _entered(holder)
        procs.append(_start(0.1, tmp_path))
        again_in, again_waited = _entered(procs[-1])
        assert again_waited == 0.0 and again_in < shake_in + 4.0
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_stuck_compilation_is_waited_for_only_so_long(tmp_path):
    procs = [_start(8.0, tmp_path, key="stuck")]
    try:
        first_in, _ = _entered(procs[0])
        procs.append(_start(0.1, tmp_path, key="stuck", max_wait_s=1.0))
        late_in, late_waited = _entered(procs[1])
        assert 1.0 <= late_waited < 2.0 and late_in < first_in + 8.0   # went ahead while the first still held it
    finally:
        for p in procs:
            p.kill()
            p.wait()
