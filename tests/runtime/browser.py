"""Open a page in headless Chromium (Debian's `chromium` package) through Playwright, and report what a
person would see go wrong: JavaScript exceptions, console errors, Bokeh documents that never rendered.

Why Debian's Chromium and not `playwright install`: the browser build Playwright downloads comes from a
host outside the package registries, which this project's machines cannot reach; `apt-get install
chromium` can (`make browser-test` does it). The flags keep Chromium off the network it would otherwise
try to reach at start-up (component updates, sync, QUIC probes), whose refused connections it logs as
errors.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHROMIUM_FLAGS = (
    "--no-sandbox",  # root in a container: Chromium's sandbox needs user namespaces it may not have
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)

#: Every Bokeh document of the page is built and idle, and each of its roots has a view that finished.
RENDERED_JS = """() => window.Bokeh !== undefined && Bokeh.documents.length > 0 && Bokeh.documents.every(
  d => d.is_idle && d.roots().length > 0 && d.roots().every(r => {
    const v = Bokeh.index.get_by_id(r.id); return v != null && v.has_finished(); }))"""

#: The columns of every data source in the page's documents, as plain arrays (NaN as null).
SOURCES_JS = """() => Bokeh.documents.flatMap(d => [...d.all_models]
  .filter(m => m.type === "ColumnDataSource")
  .map(m => Object.fromEntries(Object.entries(m.data).map(
    ([k, v]) => [k, Array.from(v, x => (typeof x === "number" && isNaN(x)) ? null : x)]))))"""

#: How many models of each type the page's documents hold (spans, legend items, ...).
MODELS_JS = """() => { const n = {}; for (const d of Bokeh.documents) for (const m of d.all_models)
  n[m.type] = (n[m.type] || 0) + 1; return n; }"""


def chromium_path() -> str | None:
    """`PIVOTRL_CHROMIUM`, else Debian's `chromium` on the PATH; None when neither is there."""
    path = os.environ.get("PIVOTRL_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    return path if path and Path(path).exists() else None


@dataclass
class PageCheck:
    """What the browser saw: `errors` (uncaught exceptions and console errors; empty means none),
    `warnings` (console warnings, reported, not failures), the number of Bokeh `documents`, the data
    sources' columns, the count of models per type, and the text of every data-table cell."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    documents: int = 0
    sources: list[dict[str, list[Any]]] = field(default_factory=list)
    models: dict[str, int] = field(default_factory=dict)
    cells: list[str] = field(default_factory=list)


def check_page(url: str, screenshot: Path | None = None, timeout_s: float = 60.0,
               width: int = 1000) -> PageCheck:
    """Load `url`, wait until its Bokeh documents have rendered (or `timeout_s`), and return what it saw;
    a full-page PNG goes to `screenshot` when given."""
    from playwright.sync_api import sync_playwright

    out = PageCheck()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=list(CHROMIUM_FLAGS))
        try:
            page = browser.new_page(viewport={"width": width, "height": 800})

            def console(msg: Any) -> None:
                if msg.type in ("error", "warning"):
                    kept = out.errors if msg.type == "error" else out.warnings
                    kept.append(f"console.{msg.type}: {msg.text}")

            page.on("pageerror", lambda exc: out.errors.append(f"uncaught: {exc}"))
            page.on("console", console)
            page.goto(url, wait_until="load", timeout=timeout_s * 1000)
            try:
                page.wait_for_function(RENDERED_JS, timeout=timeout_s * 1000, polling=100)
            except Exception as exc:  # report it with whatever errors explain it
                out.errors.append(f"Bokeh documents did not render in {timeout_s:g}s: {exc}")
                return out
            out.documents = page.evaluate("() => Bokeh.documents.length")
            out.sources = page.evaluate(SOURCES_JS)
            out.models = page.evaluate(MODELS_JS)
            out.cells = page.locator(".slick-cell").all_inner_texts()  # pierces the shadow roots
            if screenshot is not None:
                screenshot.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    return out
