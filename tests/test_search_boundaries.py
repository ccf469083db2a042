"""Only trainables/search/ imports Ray, Optuna or MLflow; everything else stays importable without them."""
from pathlib import Path

from test_boundaries import FORBIDDEN, imported_roots

ROOT = Path(__file__).resolve().parents[1]
SEARCH = ROOT / "trainables" / "search"
MAX_LINES = 400   # for every module, the merged ones too (docs/journal/2026-12-03-search-rooms.md)


def test_only_the_search_package_imports_the_search_stack():
    offenders = {str(p.relative_to(ROOT)): imported_roots(p) & FORBIDDEN for p in (ROOT / "trainables").rglob("*.py")
                 if SEARCH not in p.parents and imported_roots(p) & FORBIDDEN}
    assert not offenders, offenders


def test_every_search_module_stays_within_the_line_budget():
    sizes = {p.name: len(p.read_text().splitlines()) for p in sorted(SEARCH.glob("*.py"))}
    assert len(sizes) > 5, sizes   # the package was read
    assert not {n: v for n, v in sizes.items() if v > MAX_LINES}, sizes


def test_the_subcommands_parse_without_the_search_stack():
    """``cowtune --help`` and a bad argument answer at once: ``trainables.search.cli`` imports Ray, MLflow and
    Optuna only inside the subcommands that run."""
    import subprocess
    import sys

    code = ("import sys, trainables.search.cli; "
            "print(sorted(m for m in ('ray', 'mlflow', 'optuna') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_promote_loads_no_ray():
    """``cowtune promote`` reads MLflow only: its module imports Ray (``experiments``, ``confirm``) only inside
    ``cowtune confirm --seeds``, so it answers within seconds, as an unreachable tracking server's one line."""
    import subprocess
    import sys

    code = ("import sys, trainables.search.promote; "
            "print(sorted(m for m in ('ray', 'optuna', 'trainables.trainer') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
