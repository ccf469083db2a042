"""The algorithm code stays plain PyTorch; platform/ never becomes a Python package."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PURE = [p for sub in ("ssl", "data", "models") for p in sorted((ROOT / "trainables" / sub).glob("*.py"))] + [
    ROOT / "trainables" / n for n in ("trainer.py", "step.py", "config.py", "optim.py", "evaluate.py")
]
FORBIDDEN = {"ray", "mlflow", "optuna"}


def imported_names(path: Path) -> set[str]:
    """Every absolute import in ``path``, at its top or inside a function: ``import a.b`` gives ``a.b``;
    ``from a.b import c`` gives ``a.b`` and ``a.b.c`` (``c`` may be a module or a name)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def imported_roots(path: Path) -> set[str]:
    return {name.split(".")[0] for name in imported_names(path)}


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


def _module_graph() -> dict[str, set[str]]:
    """Each ``trainables`` module and the ``trainables`` modules it imports, at its top or inside a function."""
    modules = {}
    for path in (ROOT / "trainables").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    return {name: {e for e in imported_names(path) if e in modules and e != name and not name.startswith(e + ".")}
            for name, path in modules.items()}


def test_no_module_of_the_package_imports_itself_back():
    """No import circles in ``trainables``, counting imports inside functions: a module that one of its imports
    needs back belongs with it, or the two need a third that both import. (A package's ``__init__`` that a
    submodule imports through its dotted name is not an edge back.)"""
    graph = _module_graph()
    assert len(graph) > 40 and "trainables.step" in graph["trainables.trainer"]   # the graph was read
    state, circles = {}, []

    def visit(name, path):
        state[name] = "open"
        for nxt in sorted(graph[name]):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles:\n" + "\n".join(circles)
