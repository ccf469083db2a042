"""The algorithm code stays plain PyTorch; platform/ never becomes a Python package."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PURE = [p for sub in ("ssl", "data", "models") for p in sorted((ROOT / "trainables" / sub).glob("*.py"))] + [
    ROOT / "trainables" / n for n in ("trainer.py", "step.py", "config.py", "optim.py", "evaluate.py")
]
FORBIDDEN = {"ray", "mlflow", "optuna"}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("path", PURE, ids=lambda p: str(p.relative_to(ROOT / "trainables")))
def test_pure_modules_import_no_search_stack(path):
    assert not imported_roots(path) & FORBIDDEN, f"{path} imports {imported_roots(path) & FORBIDDEN}"


def test_platform_is_not_a_package():
    platform = ROOT / "platform"
    assert not (platform / "__init__.py").exists()
    assert not list(platform.rglob("*.py"))
    import platform as stdlib_platform
    assert hasattr(stdlib_platform, "python_version")


def test_search_driver_skips_the_compiler_stack():
    """A search driver builds no model and compiles nothing: importing it must not pull in torchvision,
    whose import loads torch._dynamo (about 2 s before Ray can start)."""
    import subprocess
    import sys

    code = ("import sys, trainables.search.driver, trainables.cli; "
            "print(sorted(m for m in ('torchvision', 'torch._dynamo') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
