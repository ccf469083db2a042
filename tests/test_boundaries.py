"""The algorithm code stays plain PyTorch; platform/ never becomes a Python package."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PURE = [p for sub in ("ssl", "data", "models") for p in sorted((ROOT / "trainables" / sub).glob("*.py"))] + [
    ROOT / "trainables" / n for n in ("trainer.py", "step.py", "config.py", "optim.py", "evaluate.py")
]
FORBIDDEN = {"ray", "mlflow", "optuna"}


def _type_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes inside ``if TYPE_CHECKING:`` blocks (imports for annotations, never run)."""
    return {id(inner) for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for stmt in node.body for inner in ast.walk(stmt)}


def imported_names(path: Path, type_only: bool = True) -> set[str]:
    """Every absolute import in ``path``, at its top or inside a function (and, with ``type_only``, under ``if
    TYPE_CHECKING:``): ``import a.b`` gives ``a.b``; ``from a.b import c`` gives ``a.b`` and ``a.b.c`` (``c`` may
    be a module or a name)."""
    tree = ast.parse(path.read_text())
    skip = set() if type_only else _type_only(tree)
    return {name for node in ast.walk(tree) if id(node) not in skip for name in _names_of(node)}


def _names_of(node: ast.AST) -> set[str]:
    """What one statement imports, as ``imported_names`` counts it (nothing for another statement, or a relative
    import)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return set()


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
    """Each ``trainables`` module and the ``trainables`` modules it imports when it runs, at its top or inside a
    function (not those imported for annotations only)."""
    modules = {}
    for path in (ROOT / "trainables").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    return {name: {e for e in imported_names(path, type_only=False)
                   if e in modules and e != name and not name.startswith(e + ".")}
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


def _package_of(module: str) -> str:
    """The package whose ``MAY_IMPORT`` rules a module: its subpackage, or ``trainables`` for the core's modules."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (ROOT / "trainables" / parts[-1]).is_dir() else "trainables"


def _may_import(package: str) -> tuple[str, ...]:
    """The ``MAY_IMPORT`` of a package's ``__init__``, read without importing it."""
    init = ROOT / Path(*package.split(".")) / "__init__.py"
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["MAY_IMPORT"]:
            return tuple(ast.literal_eval(node.value))
    raise AssertionError(f"{init} has no MAY_IMPORT")


def test_each_layer_imports_only_what_its_package_allows():
    """The layers of trainables/__init__.py: each module imports, when it runs, only its own package and what that
    package's ``MAY_IMPORT`` names (a package, a module, or a name in one). So the pure algorithm, data and models
    never reach up; ``fast`` never imports the core; the core reaches ``fast`` through ``trainables.fast.switch``."""
    graph = _module_graph()
    packages = {_package_of(m) for m in graph}
    assert packages == {"trainables", "trainables.ssl", "trainables.data", "trainables.models", "trainables.fast",
                        "trainables.search"}, packages
    wrong = []
    for module, imports in sorted(graph.items()):
        own, allowed = _package_of(module), _may_import(_package_of(module))
        for target in sorted(imports):
            if _package_of(target) != own and not any(target == a or target.startswith(a + ".") for a in allowed):
                wrong.append(f"{module} imports {target} ({own} may import {', '.join(allowed)})")
    assert not wrong, "\n".join(wrong)


def test_the_core_enters_the_fast_path_through_one_door_and_reaches_search_only_in_subcommands():
    """Of ``trainables.fast`` the core imports the switch alone, and the search package only inside functions (the
    command's subcommands): importing the core never starts Ray, Optuna or MLflow."""
    core = sorted((ROOT / "trainables").glob("*.py"))
    doors = {name for p in core for name in imported_names(p) if name.startswith("trainables.fast")}
    assert doors and all(n == "trainables.fast.switch" or n.startswith("trainables.fast.switch.") for n in doors), doors
    at_top = {str(p.relative_to(ROOT)) for p in core for node in ast.parse(p.read_text()).body
              if any(n.startswith("trainables.search") for n in _names_of(node))}
    assert not at_top, at_top


def test_the_plain_step_imports_nothing_of_the_fast_path():
    """``trainables/step.py`` is the specification: it imports nothing of ``trainables.fast``, at its top, inside a
    function or for annotations, so the fast path can only wrap it (``trainables.fast.switch.FastStep`` is handed
    ``train_step``), never reach into it; and ``fast`` imports the step only for annotations (no circle)."""
    step = ROOT / "trainables" / "step.py"
    assert {n for n in imported_names(step) if n.startswith("trainables.fast")} == set()
    for path in sorted((ROOT / "trainables" / "fast").glob("*.py")):
        assert "trainables.step" not in imported_names(path, type_only=False), path


def test_models_import_nothing_of_the_fast_path():
    """The models are plain PyTorch: the fused and folded variants are applied by ``fast`` to a built model."""
    wrong = {str(p.relative_to(ROOT)): sorted(n for n in imported_names(p) if n.startswith("trainables.fast"))
             for p in sorted((ROOT / "trainables" / "models").glob("*.py"))}
    assert not {k: v for k, v in wrong.items() if v}, wrong
