"""Open every result page in a real browser (headless Chromium), offline, as a person would, and screenshot it.

For each page: Chromium loads it with every host name unresolvable (so anything fetched from the network would be
missing), and a check script appended to a copy of the page reports what the browser saw: script errors, images
decoded (naturalWidth > 0), tables, and whether clicking a sortable header sorts its rows by that column in both
directions. Then a screenshot of the top of the page. The pages:

- demo: ``kvsim-out/demo.html`` from ``kvsim demo`` (``--demo DIR``; default: run ``kvsim demo --synthetic mixed``
  into a temporary folder);
- report: ``kvsim report`` on the demo's results store;
- fidelity, fidelity_smollm2 (the segment study) and needle: rebuilt from the committed results in
  benchmarks/results (JSON + PNG), written beside them as .html.

Writes benchmarks/results/pages.json (checks per page), the screenshots to kvsim-out/pages/ (``--out``), and the demo
page's to benchmarks/results/demo_page.png, the README's. Needs chromium (``apt-get install chromium``) or
``KVSIM_BROWSER=/path/to/chrome``.

    python -m benchmarks.pages [--demo kvsim-out] [--height 2750]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
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


def _run(browser: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
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
        res = _run(browser, "--virtual-time-budget=5000", "--dump-dom", copy.as_uri())
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
    res = _run(browser, f"--window-size={width},{height}", f"--screenshot={png}", "--virtual-time-budget=5000",
               Path(page).resolve().as_uri())
    if not png.is_file() or png.stat().st_size == 0:
        raise RuntimeError(f"{page}: no screenshot (exit {res.returncode}): {res.stderr[-800:]}")
    return png


def passed(check: dict[str, Any]) -> bool:
    """No script error, every image decoded, and clicking a header sorted the table both ways."""
    s = check.get("sorted") or {}
    return (not check["errors"] and not check["console_errors"] and all(i["ok"] for i in check["images"])
            and bool(s) and s["ascending"] and s["descending"] and s["refs_on_top"])


def build_pages(demo: Path, work: Path) -> dict[str, Path]:
    """Every page to look at: the demo's, a report of its store, and the committed model-side results' pages."""
    from gpu_validate.studies.fidelity.fidelity_page import fidelity_page, segments_page
    from gpu_validate.studies.needle.needle_page import needle_page
    from sim.cli import main as kvsim

    pages = {"demo": demo / "demo.html"}
    if kvsim(["report", str(demo / "demo-results"), "--out", str(work / "report")]) == 0:
        pages["report"] = work / "report" / "report.html"
    for name, build in (("fidelity_cpu", fidelity_page), ("fidelity_smollm2", segments_page),
                        ("needle", needle_page)):
        src = RESULTS / f"{name}.json"
        if src.is_file():
            pages[name] = build(json.loads(src.read_text()), src.with_suffix(".html"), plot=src.with_suffix(".png"),
                                command=f"rebuilt by benchmarks/pages.py from {src.relative_to(ROOT)}")
    return pages


def _shown(path: Path) -> str:
    """A path relative to the repository when it is inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo", type=Path, default=None,
                    help="a kvsim demo output folder (default: run kvsim demo --synthetic mixed into a temp folder)")
    ap.add_argument("--out", type=Path, default=ROOT / "kvsim-out" / "pages", help="screenshots folder")
    ap.add_argument("--height", type=int, default=2750,
                    help="screenshot height in pixels at width 1280 (the default shows the demo page down to its "
                         "first plot)")
    args = ap.parse_args(argv)
    browser = find_browser()
    if browser is None:
        print("no browser: apt-get install chromium, or set KVSIM_BROWSER", file=sys.stderr)
        return 2
    version = _run(browser, "--version").stdout.strip()
    with tempfile.TemporaryDirectory(prefix="kvsim-pages-") as tmp:
        work = Path(tmp)
        demo = args.demo
        if demo is None:
            from sim.cli import main as kvsim

            demo = work / "demo"
            kvsim(["demo", "--synthetic", "mixed", "--tokens", "512", "--prompt", "128", "--out", str(demo)])
        results: dict[str, Any] = {}
        for name, page in build_pages(demo, work).items():
            check = check_in_browser(page, browser)
            shot = screenshot(page, args.out / f"{name}.png", browser, height=args.height)
            results[name] = {"page": _shown(page), "bytes": page.stat().st_size, "screenshot": _shown(shot),
                             "passed": passed(check), **check}
            print(f"{name:>18s}: {'ok' if results[name]['passed'] else 'FAILED'}  images "
                  f"{sum(i['ok'] for i in check['images'])}/{len(check['images'])}, tables {check['tables']}, "
                  f"sort {check['sorted']}, errors {check['errors'] + check['console_errors']}")
    from benchmarks._util import machine, write_result

    if "demo" in results:
        shutil.copyfile(ROOT / results["demo"]["screenshot"], RESULTS / "demo_page.png")
    write_result("pages", {"browser": version, "pages": results, "machine": machine()})
    return 0 if all(r["passed"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
