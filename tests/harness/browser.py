"""A real browser, headless: Debian's Chromium driven by Playwright (its own browser downloads cannot run here).

Chromium starts with the flags this machine needs: no sandbox (root), no GPU, and no background networking,
whose connections the closed network refuses. Each call gets a fresh profile.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip


@dataclass
class PageVisit:
    title: str
    console_errors: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    images: list[dict] = field(default_factory=list)  # src, naturalWidth, naturalHeight
    tables: dict[str, int] = field(default_factory=dict)  # table id -> rows
    text: str = ""


def chromium() -> str:
    path = shutil.which("chromium")
    if not path:
        raise AssertionError("Chromium is missing: apt-get install chromium (make test's system-deps installs it)")
    return path


def visit(url: str, screenshot: Path | None = None, *, wait_ms: int = 1500) -> PageVisit:
    """Load ``url``, wait for it to settle, and report what a user's browser saw (and logged)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:  # pragma: no cover - the test extra installs it
        raise AssertionError("playwright is missing: pip install -e '.[test]'") from None
    with tempfile.TemporaryDirectory(prefix="batchlens-chromium-") as profile, sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            profile, executable_path=chromium(), args=CHROMIUM_FLAGS, viewport={"width": 1600, "height": 1100}
        )
        try:
            page = browser.new_page()
            errors: list[str] = []
            failed: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("requestfailed", lambda r: failed.append(f"{r.url}: {r.failure}"))
            page.goto(url, wait_until="load")
            page.wait_for_timeout(wait_ms)
            seen = PageVisit(**_read(page))
            # What the page did up to here is the visit; a reload the page starts itself later (or one the
            # closing browser aborts) is not.
            seen.console_errors, seen.failed_requests = list(errors), list(failed)
            if screenshot is not None:
                page.screenshot(path=str(screenshot), full_page=True)
            return seen
        finally:
            browser.close()


# One evaluation reads the whole page: a page that reloads itself (the report's live page does, every few
# seconds) cannot swap documents in the middle of it, as it could between several calls on a loaded machine.
READ_PAGE = """() => ({
    title: document.title,
    images: [...document.images].map(e => ({src: e.src, naturalWidth: e.naturalWidth, naturalHeight: e.naturalHeight})),
    tables: Object.fromEntries([...document.querySelectorAll("table")].map(e => [e.id, e.rows.length])),
    text: document.body.innerText,
})"""


def _read(page) -> dict:
    """What the page shows; a reload that lands between the wait and the read is waited out, and read again."""
    from playwright.sync_api import Error

    for _ in range(2):
        try:
            return page.evaluate(READ_PAGE)
        except Error as exc:
            if "Execution context was destroyed" not in str(exc):
                raise
            page.wait_for_load_state("load")
    return page.evaluate(READ_PAGE)
