#!/usr/bin/env bash
# Set up a virtual environment with everything the tests need, then run them.
# torch 2.14.1 / torchvision 0.29.1 install from local disk on the development and CI machines.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
log=$(mktemp)
if ! .venv/bin/python -m pip install --disable-pip-version-check -e '.[dev]' >"$log" 2>&1; then
    grep -v "is ignored: it is neither" "$log" >&2; exit 1
fi
exec .venv/bin/python -m pytest -q "$@"
