#!/usr/bin/env bash
# Set up a virtual environment with everything the tests need, then run them.
# torch 2.14.1 / torchvision 0.29.1 install from local disk on the development and CI machines.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
log=$(mktemp)
# tests/test_cluster.py runs `ray up`/`ray submit` against its own sshd on 127.0.0.1 (reached through nc, as
# it listens on a free port); the launcher also needs rsync.
# tests/test_team_stack.py starts its own PostgreSQL server (Debian's package) on 127.0.0.1; tests/test_compose.py
# validates docker-compose.yml with Debian's docker-compose (Compose v1's `config`: no engine needed); the UI
# screenshots (tests/ui_screens.py) drive Debian's Chromium with the playwright package (no browser download).
missing=$(for tool in /usr/sbin/sshd ssh rsync nc; do command -v "$tool" >/dev/null || echo "$tool"; done
          ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || echo postgresql
          command -v docker-compose >/dev/null || echo docker-compose
          [ -x /usr/bin/chromium ] || echo chromium)
if [ -n "$missing" ]; then
    sudo=$([ "$(id -u)" = 0 ] || echo sudo)
    policy=/usr/sbin/policy-rc.d   # keep apt from starting a system sshd on 0.0.0.0:22 while installing it
    made_policy=
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null && $sudo chmod +x "$policy" && made_policy=1
    fi
    wait_lock=(-o DPkg::Lock::Timeout=300)   # a fresh VM may be running unattended upgrades
    if ! { $sudo apt-get "${wait_lock[@]}" update -qq && $sudo env DEBIAN_FRONTEND=noninteractive apt-get \
            "${wait_lock[@]}" install -y -qq --no-install-recommends openssh-server openssh-client rsync \
            netcat-openbsd postgresql docker-compose chromium fonts-liberation; } >"$log" 2>&1; then
        cat "$log" >&2; [ -z "$made_policy" ] || $sudo rm -f "$policy"; exit 1
    fi
    [ -z "$made_policy" ] || $sudo rm -f "$policy"
    if [ -d /run/systemd/system ]; then   # nor at the next boot: the tests start their own sshd on 127.0.0.1
        $sudo systemctl disable --now ssh.service ssh.socket postgresql.service >/dev/null 2>&1 || true
    fi
fi
if ! .venv/bin/python -m pip install --disable-pip-version-check -e '.[dev]' >"$log" 2>&1; then
    grep -v "is ignored: it is neither" "$log" >&2; exit 1
fi
# Four workers on CI's 2 cores, a module whole on one, the tests that start a local Ray one at a time
# (tests/conftest.py). Most long tests wait on other processes (a search's driver, its trials, the servers), so
# workers beyond the core count fill that time: the whole suite took 1590 s on 2 workers, 1166 s on 3, 1031 s on 4
# (2 cores under other load, docs/journal/2026-12-03-suite.md). COWTUNE_TEST_WORKERS picks another count. Threads
# waiting at an OpenMP barrier sleep instead of spinning: on 2 cores shared by the workers, spinning threads take
# the core from the thread they wait for (a 67 s learning test took 615 s).
export OMP_WAIT_POLICY=PASSIVE
exec .venv/bin/python -m pytest -q -n "${COWTUNE_TEST_WORKERS:-4}" --dist loadscope --durations=30 "$@"
