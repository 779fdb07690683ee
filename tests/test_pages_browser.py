"""A result page in a real browser (headless Chromium), offline: no script error, every image decoded, a click on a
header sorts the table both ways with the references kept on top, and a screenshot is drawn. Skipped where no
browser is installed (CI); ``python -m benchmarks.pages`` does the same for every committed page."""
from __future__ import annotations

import pandas as pd
import pytest

from sim.reports.browser_check import check_in_browser, find_browser, passed, screenshot
from sim.reports.sweep_page import sweep_page
from sim.reports.report import plot_budget_curves

BROWSER = find_browser()
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no Chromium/Chrome installed (apt-get install chromium)")


def _results() -> pd.DataFrame:
    loss = {"full": 0.0, "oracle": 0.2, "h2o": 0.5, "tova": 0.4, "buzz": 0.7, "window": 0.9}
    return pd.DataFrame([{"trace": "t", "trace_id": "x", "policy": lab, "label": lab, "budget": b,
                          "err_mean": e / b * 16, "mass_mean": 1 - e / b * 4, "slots_mean": float(b),
                          "kv_bytes_mean": 512.0 * b} for lab, e in loss.items() for b in (16, 32, 64)])


def test_page_works_offline_in_a_browser(tmp_path):
    df = _results()
    png = plot_budget_curves(df, tmp_path / "curves.png")
    page = sweep_page(df, tmp_path / "page.html", title="browser check", figures={"budget_curves": png})
    check = check_in_browser(page, BROWSER)
    assert passed(check), check
    assert check["sorted"]["rows"] == 4 and check["images"][0]["width"] > 500
    shot = screenshot(page, tmp_path / "shot.png", BROWSER, width=1000, height=900)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_the_check_catches_a_broken_page(tmp_path):
    df = _results()
    page = sweep_page(df, tmp_path / "page.html", title="broken", figures={})
    html = page.read_text(encoding="utf-8")
    broken = html.replace('th.addEventListener("click", sort);', 'th.addEventListener("click", function () { x(); });')
    broken = broken.replace("<main>", '<main><img src="https://example.invalid/x.png" alt="remote">')
    (tmp_path / "broken.html").write_text(broken, encoding="utf-8")
    check = check_in_browser(tmp_path / "broken.html", BROWSER)
    assert not passed(check) and not check["images"][0]["ok"] and check["errors"]
