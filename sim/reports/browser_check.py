"""A result page in a real browser (headless Chromium or Chrome), offline, as a person would see it.

`check_in_browser` loads a copy of the page with every host name unresolvable (anything fetched from the network
would be missing) and a check script appended (`CHECK_SCRIPT`) that reports what the browser saw: script errors,
images decoded (naturalWidth > 0), tables, and whether clicking a sortable header sorts its rows by that column in
both directions with the reference rows kept on top; `passed` judges that report; `screenshot` draws the top of a
page. The pages kvsim writes (`sim.reports.webpage`) are self-contained, so they pass offline.
tests/test_pages_browser.py runs this on a sweep page, and ``python -m benchmarks.pages`` on every committed page.
Needs a browser: `find_browser` (``KVSIM_BROWSER=/path/to/chrome``, else chromium or chrome on the PATH).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")

#: appended to a copy of the page: runs after the page's own script, writes its findings into the DOM
CHECK_SCRIPT = r"""
<script>
(function () {
  var out = {errors: window.__kvsimErrors || [], images: [], tables: 0, sorted: null};
  document.querySelectorAll("img").forEach(function (im) {
    out.images.push({ok: im.complete && im.naturalWidth > 0, width: im.naturalWidth});
  });
  out.tables = document.querySelectorAll("table").length;
  var t = document.querySelector("table.sortable.ranked") || document.querySelector("table.sortable");
  if (t) {
    var th = Array.prototype.slice.call(t.querySelectorAll("th[data-col]")).filter(function (h) {
      return /mean/.test(h.textContent); })[0] || t.querySelector("th[data-col]");
    var col = +th.dataset.col;
    var values = function () {
      return Array.prototype.slice.call(t.tBodies[0].rows).filter(function (r) {
        return !r.classList.contains("ref"); }).map(function (r) {
        return parseFloat(r.cells[col].dataset.v); }).filter(function (v) { return !isNaN(v); });
    };
    var mono = function (v, up) { for (var i = 1; i < v.length; i++) {
      if (up ? v[i] < v[i - 1] : v[i] > v[i - 1]) { return false; } } return true; };
    th.click(); var a = values(); th.click(); var d = values();
    out.sorted = {column: th.textContent.trim(), ascending: mono(a, true), descending: mono(d, false),
                  rows: a.length, refs_on_top: t.tBodies[0].rows[0].classList.contains("ref") ||
                                              !t.querySelector("tr.ref")};
  }
  var pre = document.createElement("pre");
  pre.id = "kvsim-check";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();
</script>
"""
ERRORS_HOOK = "<script>window.__kvsimErrors=[];window.addEventListener('error',function(e){" \
              "window.__kvsimErrors.push(String(e.message||e));});</script>"
OFFLINE = ["--host-resolver-rules=MAP * ~NOTFOUND", "--disable-background-networking"]


def find_browser() -> str | None:
    """Chromium or Chrome: ``KVSIM_BROWSER``, else the first of `BROWSERS` on the PATH."""
    env = os.environ.get("KVSIM_BROWSER")
    if env:
        return env
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


def run_browser(browser: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``browser`` headless and offline (a fresh profile, no network) with ``args``."""
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
             "--disable-dev-shm-usage", *OFFLINE]
    with tempfile.TemporaryDirectory(prefix="kvsim-browser-") as profile:
        return subprocess.run([browser, *flags, f"--user-data-dir={profile}", *args], capture_output=True,
                              text=True, timeout=timeout)


def check_in_browser(page: str | os.PathLike, browser: str) -> dict[str, Any]:
    """What the browser saw on the page (see `CHECK_SCRIPT`), offline."""
    html = Path(page).read_text(encoding="utf-8")
    probe = html.replace("<head>", "<head>" + ERRORS_HOOK, 1).replace("</body>", CHECK_SCRIPT + "</body>", 1)
    with tempfile.TemporaryDirectory(prefix="kvsim-page-") as tmp:
        copy = Path(tmp) / Path(page).name
        copy.write_text(probe, encoding="utf-8")
        res = run_browser(browser, "--virtual-time-budget=5000", "--dump-dom", copy.as_uri())
    m = re.search(r'<pre id="kvsim-check">(.*?)</pre>', res.stdout, re.S)
    if not m:
        raise RuntimeError(f"{page}: the browser did not run the check (exit {res.returncode}): {res.stderr[-800:]}")
    out = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">"))
    out["console_errors"] = [line for line in res.stderr.splitlines() if "Uncaught" in line]
    return out


def screenshot(page: str | os.PathLike, png: str | os.PathLike, browser: str, *, width: int = 1280,
               height: int = 2000) -> Path:
    """A screenshot of the top ``height`` pixels of the page at ``width``, offline."""
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    res = run_browser(browser, f"--window-size={width},{height}", f"--screenshot={png}",
                      "--virtual-time-budget=5000", Path(page).resolve().as_uri())
    if not png.is_file() or png.stat().st_size == 0:
        raise RuntimeError(f"{page}: no screenshot (exit {res.returncode}): {res.stderr[-800:]}")
    return png


def passed(check: dict[str, Any]) -> bool:
    """No script error, every image decoded, and clicking a header sorted the table both ways."""
    s = check.get("sorted") or {}
    return (not check["errors"] and not check["console_errors"] and all(i["ok"] for i in check["images"])
            and bool(s) and s["ascending"] and s["descending"] and s["refs_on_top"])


__all__ = ["check_in_browser", "find_browser", "passed", "run_browser", "screenshot"]
