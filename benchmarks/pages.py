"""Open every result page in a real browser (headless Chromium), offline, as a person would, and screenshot it.

For each page: `sim.reports.browser_check.check_in_browser` (Chromium loads it with every host name unresolvable,
so anything fetched from the network would be missing, and a check script appended to a copy of the page reports
what the browser saw: script errors, images decoded, tables, and whether clicking a sortable header sorts its rows
by that column in both directions), then a screenshot of the top of the page. The pages:

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
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from sim.reports.browser_check import check_in_browser, find_browser, passed, run_browser, screenshot

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


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
    version = run_browser(browser, "--version").stdout.strip()
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
