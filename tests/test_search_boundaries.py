"""Only trainables/search/ imports Ray, Optuna or MLflow; everything else stays importable without them."""
from pathlib import Path

from test_boundaries import FORBIDDEN, imported_roots

ROOT = Path(__file__).resolve().parents[1]
SEARCH = ROOT / "trainables" / "search"
GLUE = {"tune_trainable.py", "driver.py", "experiments.py", "tracking.py", "promote.py", "final_job.py", "ddp.py",
        "job_settings.py"}


def test_only_the_search_package_imports_the_search_stack():
    offenders = {str(p.relative_to(ROOT)): imported_roots(p) & FORBIDDEN for p in (ROOT / "trainables").rglob("*.py")
                 if SEARCH not in p.parents and imported_roots(p) & FORBIDDEN}
    assert not offenders, offenders


def test_glue_modules_stay_small():
    sizes = {n: len((SEARCH / n).read_text().splitlines()) for n in GLUE}
    assert all(v <= 150 for v in sizes.values()), sizes
