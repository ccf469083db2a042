"""The machine-wide first-compile lock: the first process compiles alone, the ones that waited go on together."""
from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

from trainables.fast.compile_lock import LOCK_NAME, cache_folder, first_compile_lock, step_key

# A compiling process under the test's control: it gets ready (imports torch: seconds), asks for the lock
# when told "go", says when it got in, and holds the lock until it is told its compilation is done.
COMPILER = """
import sys, time
from trainables.fast.compile_lock import cache_folder, first_compile_lock
cache_folder()
print("ready", flush=True)
sys.stdin.readline()
with first_compile_lock(sys.argv[1], max_wait_s=float(sys.argv[2])) as info:
    print(f"in {time.time()} {info['waited_s']}", flush=True)
    sys.stdin.readline()
"""
WAIT_S = 120.0   # for a line from a child: generous on a loaded machine; a hang becomes a failure


def _line(proc: subprocess.Popen) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], WAIT_S)
    assert ready, f"no line from the compiling process in {WAIT_S} s"
    return proc.stdout.readline()


def _start(cache: Path, key: str = "wrn", max_wait_s: float = 60.0) -> subprocess.Popen:
    """A compiling process, ready (torch imported) but not yet asking for the lock."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", COMPILER, key, str(max_wait_s)], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert _line(proc).strip() == "ready"
    return proc


def _tell(proc: subprocess.Popen) -> None:
    """'go' to a ready process; 'done compiling' to one that got in."""
    proc.stdin.write("\n")
    proc.stdin.flush()


def _entered(proc: subprocess.Popen) -> tuple[float, float]:
    word, at, waited = _line(proc).split()
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
    procs = []
    try:
        first = _start(tmp_path)
        procs.append(first)
        _tell(first)
        first_in, first_waited = _entered(first)
        assert first_waited == 0.0
        a, b = _start(tmp_path), _start(tmp_path)
        procs += [a, b]
        _tell(a)
        _tell(b)
        time.sleep(2.0)                  # both ask for the lock while the first one compiles
        released = time.time()
        _tell(first)                     # the first compilation is done
        (a_in, a_waited), (b_in, b_waited) = _entered(a), _entered(b)
        # both waited for the first one, then compiled at the same time
        assert a_in >= released and b_in >= released
        assert a_waited > 1.0 and b_waited > 1.0
        assert abs(a_in - b_in) < 1.0
        # one that comes while the waiters compile joins them at once: nobody compiles alone then
        late = _start(tmp_path, key="resnet")
        procs.append(late)
        _tell(late)
        _, late_waited = _entered(late)
        assert late_waited < 0.5
        for p in (a, b, late):
            _tell(p)
            p.wait(WAIT_S)
        # a step like the first one's, once it has compiled, needs no lock even while someone compiles another
        holder = _start(tmp_path, key="shake")
        procs.append(holder)
        _tell(holder)
        _, holder_waited = _entered(holder)
        assert holder_waited == 0.0      # alone: it holds the lock exclusively
        again = _start(tmp_path)
        procs.append(again)
        _tell(again)
        _, again_waited = _entered(again)   # while the holder still holds the lock
        assert again_waited == 0.0
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_stuck_compilation_is_waited_for_only_so_long(tmp_path):
    procs = []
    try:
        stuck = _start(tmp_path, key="stuck")
        procs.append(stuck)
        _tell(stuck)
        _entered(stuck)                  # and never told it is done
        late = _start(tmp_path, key="stuck", max_wait_s=1.0)
        procs.append(late)
        _tell(late)
        _, late_waited = _entered(late)
        assert 1.0 <= late_waited < 5.0  # went ahead while the first one still held the lock
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_operator_changes_key_the_compile_caches(tmp_path, monkeypatch):
    """Importing the operators puts their sources' hash into torch.compile's cache-key tag (a tag the user set is
    kept), and the hash follows the sources: a cached backward of an older operator is never loaded."""
    import torch.compiler.config as compiler

    import trainables.fast.compile_lock as cl
    import trainables.fast.fast_conv  # noqa: F401   (tags the caches on import)

    ours = f"cowtune-operators-{cl.operators_version()}"
    assert ours in compiler.cache_key_tag
    before = compiler.cache_key_tag   # set and restored by hand: monkeypatch's undo would delete (hide) a torch config
    try:
        compiler.cache_key_tag = "users-own"
        cl.tag_compile_caches()
        cl.tag_compile_caches()
        assert compiler.cache_key_tag == f"users-own+{ours}"
    finally:
        compiler.cache_key_tag = before
    for name in cl.OPERATOR_SOURCES:
        (tmp_path / name).write_bytes((Path(cl.__file__).parent / name).read_bytes())
    monkeypatch.setattr(cl, "__file__", str(tmp_path / "compile_lock.py"))
    try:
        cl.operators_version.cache_clear()   # read once per process
        assert cl.operators_version() == ours.rsplit("-", 1)[1]
        (tmp_path / "fast_conv.py").write_text("# changed\n", encoding="utf-8")
        cl.operators_version.cache_clear()
        assert cl.operators_version() != ours.rsplit("-", 1)[1]
    finally:
        cl.operators_version.cache_clear()
