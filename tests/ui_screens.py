"""Screenshots of a running stack's web UIs in headless Chromium: the MLflow UI (a search's parent run, one trial's
`val/error_teacher` chart and its mask gallery and learning-curve artifacts) and optuna-dashboard (the study's
optimisation history). Helpers for the tests, not a test module.

Chromium is Debian's (`apt-get install chromium`, /usr/bin/chromium; COWTUNE_CHROMIUM names another), driven by the
`playwright` package from PyPI, whose bundled driver needs no browser download (`playwright install` is never
run). Each page is screenshotted only once the text that proves it shows the records (the run's name, the chart's
legend, the loaded image, the study's plotted trials) is rendered: a blank page, an error page or a page of other
runs raises AssertionError naming what did not show, and leaves `<name>-FAILED.png` beside the others.

Both UIs are single-page apps: MLflow 3.17's routes are hash routes (`/#/experiments/<id>/runs/<run>[/tab]`),
optuna-dashboard 0.21's are paths (`/dashboard/studies/<id>`).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
MASKS_FILE = "masks.png"            # trainables/search/trial.py: the trial's mask gallery
CURVE_FILE = "learning_curve.png"   # trainables/search/trial.py CURVE_FILE: the trial's learning curve
METRIC = "val/error_teacher"        # trainables/metrics.py VAL_ERROR_TEACHER: what the search minimises
VIEWPORT = {"width": 1440, "height": 900}
# Headless (Playwright adds --headless); a closed network: nothing in the background (updates, sync, field trials),
# no QUIC; --no-sandbox as CI runs as root.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]
# MLflow 3.17 opens in its GenAI view with its assistant panel over a third of the page: the classic "Model
# training" view (Runs / Models in the side bar) and no panel, set as the UI itself stores them.
MLFLOW_UI_STATE = {"mlflow.workflowType_v1": json.dumps("machine_learning"), "mlflow.assistant.panelOpen_v1": "false",
                   "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": "true"}


def chromium_path() -> str | None:
    """Debian's Chromium (or COWTUNE_CHROMIUM), or None."""
    named = os.environ.get("COWTUNE_CHROMIUM")
    if named:
        return named if os.access(named, os.X_OK) else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


def missing_browser() -> str | None:
    """Why the screenshots cannot be taken here (no Chromium, no playwright package), or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install playwright; no browser download needed)"
    if chromium_path() is None:
        return "Chromium is not installed (apt-get install chromium)"
    return None


def skip_without_browser() -> None:
    """pytest.skip with the reason when Chromium or the playwright package is missing."""
    import pytest

    reason = missing_browser()
    if reason:
        pytest.skip(reason)


def needs_browser():
    """A skipif mark for a test (or pytestmark) that takes screenshots."""
    import pytest

    reason = missing_browser()
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def screenshots_dir() -> Path:
    """Where screenshots go: $COWTUNE_SCREENSHOTS, else artifacts/screenshots/ at the repository root (made)."""
    path = Path(os.environ.get("COWTUNE_SCREENSHOTS") or ROOT / "artifacts" / "screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def browser_page(base_url: str, local_storage: dict[str, str] | None = None) -> Iterator:
    """A Playwright page in a fresh headless Chromium (a new temporary profile each time) that reaches only
    base_url's host: any other request is aborted, so nothing waits on the closed network. local_storage is set
    on every page load before the page's own scripts run."""
    from playwright.sync_api import sync_playwright

    allowed = urllib.parse.urlsplit(base_url).netloc

    def only_the_stack(route):
        parts = urllib.parse.urlsplit(route.request.url)
        if parts.scheme in ("http", "https", "ws", "wss") and parts.netloc != allowed:
            route.abort()
        else:
            route.continue_()

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport=VIEWPORT, device_scale_factor=1)
            context.route("**/*", only_the_stack)
            if local_storage:
                context.add_init_script("".join(f"window.localStorage.setItem({json.dumps(k)}, {json.dumps(v)});"
                                                for k, v in local_storage.items()))
            page = context.new_page()
            page.errors = []   # uncaught page errors, named in a failure's message
            page.on("pageerror", lambda exc: page.errors.append(str(exc)[:300]))
            yield page
        finally:
            browser.close()


def _visible_text(page) -> str:
    try:
        return " | ".join(line.strip() for line in page.inner_text("body", timeout=2000).splitlines() if line.strip())
    except Exception as exc:   # noqa: BLE001 - only for the failure message
        return f"(no text: {exc})"


def _fail(page, out_dir: Path, name: str, what: str) -> None:
    shot = out_dir / f"{name}-FAILED.png"
    with contextlib.suppress(Exception):
        page.screenshot(path=str(shot))
    errors = f"; page errors: {page.errors[:3]}" if getattr(page, "errors", None) else ""
    raise AssertionError(f"{what} at {page.url} (screenshot {shot}); the page shows: "
                         f"{_visible_text(page)[:1200]!r}{errors}")


def goto(page, url: str, out_dir: Path, name: str, timeout: float = 60) -> None:
    """Open url (its response: what it renders is waited for after); a page that cannot be loaded (no server, a
    refused connection) is AssertionError too. The content's waits take their own, often shorter, timeouts."""
    try:
        page.goto(url, wait_until="commit", timeout=timeout * 1000)
    except Exception as exc:   # playwright's Error: net::ERR_CONNECTION_REFUSED and the like
        _fail(page, out_dir, name, f"{url} did not load ({str(exc).splitlines()[0]})")


def wait_for_texts(page, texts: list[str], out_dir: Path, name: str, timeout: float, what: str = "") -> None:
    """Wait until every text is part of the page's rendered text (document.body.innerText: what is shown, not
    hidden markup); otherwise AssertionError naming the texts missing."""
    deadline = time.monotonic() + timeout
    missing = list(texts)
    while True:
        with contextlib.suppress(Exception):   # a page mid-navigation has no body for a moment
            shown = page.evaluate("() => document.body ? document.body.innerText : ''")
            missing = [t for t in texts if t not in shown]
        if not missing:
            return
        if time.monotonic() > deadline:
            _fail(page, out_dir, name, f"{what or name}: {missing} did not show within {timeout:.0f} s")
        page.wait_for_timeout(250)


def wait_for_js(page, predicate: str, arg, out_dir: Path, name: str, timeout: float, what: str) -> None:
    """Wait until the JavaScript function predicate(arg) is true; otherwise AssertionError naming what."""
    try:
        page.wait_for_function(predicate, arg=arg, timeout=timeout * 1000)
    except Exception:   # playwright's TimeoutError, or an error thrown by the page
        _fail(page, out_dir, name, f"{what} (waited {timeout:.0f} s)")


def shoot(page, out_dir: Path, name: str) -> Path:
    page.wait_for_timeout(600)   # let charts finish their transitions
    path = out_dir / f"{name}.png"
    page.screenshot(path=str(path))
    return path


def page_shows(url: str, texts: list[str], out_dir: Path, name: str, timeout: float = 30,
               local_storage: dict[str, str] | None = None) -> Path:
    """A screenshot <name>.png of url once every text shows on it, else AssertionError naming the texts missing."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with browser_page(url, local_storage) as page:
        goto(page, url, out_dir, name)
        wait_for_texts(page, texts, out_dir, name, timeout)
        return shoot(page, out_dir, name)


def check_png(path: Path, min_bytes: int = 10_000) -> None:
    """A real screenshot: a PNG of the viewport's size, over min_bytes, with more than a few colours (a blank or
    nearly blank page has a handful)."""
    from PIL import Image

    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert len(data) >= min_bytes, f"{path} has only {len(data)} bytes"
    with Image.open(io.BytesIO(data)) as img:
        assert img.size == (VIEWPORT["width"], VIEWPORT["height"]), f"{path} is {img.size}"
        colours = img.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colours is None or len(colours) > 32, f"{path} has only {len(colours)} colours: a blank page?"


def _mlflow_get(uri: str, path: str, **params) -> dict:
    url = f"{uri.rstrip('/')}/api/2.0/mlflow/{path}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.load(resp)
    except OSError as exc:
        raise AssertionError(f"the MLflow server at {uri} did not give {path} {params}: {exc}") from exc


def run_name(uri: str, run_id: str) -> str:
    """A run's name, from the tracking server's REST API."""
    return _mlflow_get(uri, "runs/get", run_id=run_id)["run"]["info"]["run_name"]


def newest_children(uri: str, experiment_id: str, parent_run_id: str, n: int = 3) -> list[str]:
    """The names of the parent run's n newest child runs, from the REST API: the parent's page lists its 10
    newest (more on a click), so these are the ones it must show."""
    body = json.dumps({"experiment_ids": [str(experiment_id)], "max_results": n,
                       "filter": f"tags.`mlflow.parentRunId` = '{parent_run_id}'",
                       "order_by": ["attributes.start_time DESC"]}).encode()
    req = urllib.request.Request(f"{uri.rstrip('/')}/api/2.0/mlflow/runs/search", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            runs = json.load(resp).get("runs", [])
    except OSError as exc:
        raise AssertionError(f"the MLflow server at {uri} did not search the child runs of {parent_run_id}: "
                             f"{exc}") from exc
    return [r["info"]["run_name"] for r in runs]


def mlflow_pages(uri: str, experiment_id: str, parent_run_id: str, child_run_id: str, out_dir: Path,
                 prefix: str = "", metric: str = METRIC, artifacts: tuple[str, ...] = (MASKS_FILE, CURVE_FILE),
                 timeout: float = 30, parent_texts: tuple[str, ...] = ()) -> list[Path]:
    """Screenshots of the MLflow UI at uri (the tracking server, e.g. http://127.0.0.1:5000) of a search: the parent
    run's page (its name, id and its newest child runs shown), the trial's model-metrics tab filtered to
    `metric` (its chart with the legend "<trial run> (<metric>)" and a drawn line), and each of the trial's
    `artifacts` in its artifacts tab (the image loaded). Returns the PNG paths, in that order:
    <prefix>mlflow-parent-run.png, <prefix>mlflow-trial-metric.png, <prefix>mlflow-trial-<artifact stem>.png...
    ``parent_texts``: more text the parent run's page must show (its description, a metric).
    Raises AssertionError naming what did not show."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = uri.rstrip("/")
    parent, child = run_name(base, parent_run_id), run_name(base, child_run_id)
    children = newest_children(base, experiment_id, parent_run_id)
    assert children, f"the run {parent!r} ({parent_run_id}) has no child runs"
    run_url = f"{base}/#/experiments/{experiment_id}/runs"
    shots = []
    with browser_page(base, MLFLOW_UI_STATE) as page:
        name = f"{prefix}mlflow-parent-run"
        goto(page, f"{run_url}/{parent_run_id}", out_dir, name)
        wait_for_texts(page, [parent, parent_run_id, "Child runs", *children, *parent_texts], out_dir, name, timeout,
                       f"the parent run {parent!r} with its newest child runs {children}")
        shots.append(shoot(page, out_dir, name))

        name = f"{prefix}mlflow-trial-metric"
        goto(page, f"{run_url}/{child_run_id}/model-metrics", out_dir, name)
        wait_for_texts(page, [child, "Model metrics"], out_dir, name, timeout, f"the trial run {child!r}")
        search = page.get_by_placeholder("Search metric charts")
        try:
            search.fill(metric, timeout=timeout * 1000)
        except Exception:
            _fail(page, out_dir, name, "the metric charts' search box did not show")
        legend = f"{child} ({metric})"
        wait_for_texts(page, [legend], out_dir, name, timeout, f"the chart of {metric} of {child!r}")
        wait_for_js(page, "() => document.querySelectorAll('.js-plotly-plot .scatterlayer path.js-line').length > 0",
                    None, out_dir, name, timeout, f"no line drawn in the chart of {metric}")
        shots.append(shoot(page, out_dir, name))

        for artifact in artifacts:
            name = f"{prefix}mlflow-trial-{Path(artifact).stem.replace('_', '-')}"
            # a new document each time: the artifact view keeps its selection across hash changes
            page.goto("about:blank")
            goto(page, f"{run_url}/{child_run_id}/artifacts/{artifact}", out_dir, name)
            wait_for_texts(page, [child, "Artifacts", f"artifacts/{artifact}"], out_dir, name, timeout,
                           f"the artifact {artifact!r} of {child!r}")
            wait_for_js(page, """a => Array.from(document.images).some(i => i.alt === a && i.complete
                                                                          && i.naturalWidth > 0)""",
                        artifact, out_dir, name, timeout, f"the image {artifact!r} did not load")
            shots.append(shoot(page, out_dir, name))
    return shots


def optuna_pages(dashboard_url: str, study_id: int, study_name: str, out_dir: Path, prefix: str = "",
                 min_points: int = 1, timeout: float = 30) -> list[Path]:
    """A screenshot of optuna-dashboard at dashboard_url (e.g. http://127.0.0.1:8080) of the study's page, whose
    first plot is the optimisation history: the study's name and id in the title bar and at least min_points trials
    plotted in the history (a trial with a value is one point). Returns [<prefix>optuna-history.png].
    Raises AssertionError naming what did not show."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = dashboard_url.rstrip("/")
    name = f"{prefix}optuna-history"
    with browser_page(base) as page:
        goto(page, f"{base}/dashboard/studies/{study_id}", out_dir, name)
        wait_for_texts(page, [f"{study_name} (id={study_id})", "History", "Objective"], out_dir, name, timeout,
                       f"the study {study_name!r} (id {study_id}) with its history plot")
        wait_for_js(page, "n => document.querySelectorAll('#plot-history .scatterlayer .point').length >= n",
                    min_points, out_dir, name, timeout, f"fewer than {min_points} trials plotted in the history")
        return [shoot(page, out_dir, name)]
