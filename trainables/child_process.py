"""Start ``python -m trainables.<module>`` children that can import this package wherever it lives
(a checkout on PYTHONPATH, an installed copy, a Ray worker's working folder)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

_PACKAGE_PARENT = str(Path(__file__).resolve().parents[1])


def module_command(module: str, *args: str) -> tuple[list[str], dict[str, str]]:
    """(argv, env) that run ``python -m module args...`` with this interpreter and this package importable."""
    path = os.pathsep.join(filter(None, [_PACKAGE_PARENT, os.environ.get("PYTHONPATH")]))
    return [sys.executable, "-m", module, *args], {**os.environ, "PYTHONPATH": path}
