"""Self-contained HTML pages: a header of facts, sections, embedded figures, sortable tables and a legend.

A page is one file that works offline: images are embedded as base64 PNG, the style and the few lines of script
that sort a table by a clicked header are inline, and nothing is fetched (no CDN, no font, no URL). Without
script the tables are still in rank order. `sim.reports.sweep_page` (sweeps) and the studies' pages in
`gpu_validate.studies` (fidelity, retrieval, recommendation) compose their pages from these parts;
`ranked_table_html` draws a `sim.reports.table.RankedTable`, the same object the terminal prints.
"""
from __future__ import annotations

import base64
import html
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from sim.replay.metrics import Column
from sim.reports.plotting import current_umask
from sim.reports.runinfo import kvsim_version, now
from sim.reports.table import ROLE_DOCS, RankedTable, fmt3, legend_items

CSS = """
:root{--fg:#1d2125;--muted:#5f6b76;--line:#d9dee3;--best:#dff3e4;--ref:#f3f4f6;--accent:#1f5fa8}
*{box-sizing:border-box}
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;color:var(--fg);
 margin:0 auto;padding:1.5em 2em 3em;max-width:1280px}
h1{font-size:1.6em;margin:.2em 0}h2{font-size:1.25em;margin:1.6em 0 .4em;border-bottom:1px solid var(--line);
 padding-bottom:.2em}h3{font-size:1.05em;margin:1.2em 0 .3em}
p.lede{color:var(--muted);margin:.2em 0 1em;max-width:72em}
dl.facts{display:grid;grid-template-columns:repeat(auto-fill,minmax(300px,1fr));gap:.3em 1.5em;margin:0;
 padding:.8em 1em;background:#f7f8fa;border:1px solid var(--line);border-radius:6px}
dl.facts div{display:flex;gap:.6em}dl.facts dt{color:var(--muted);min-width:6.5em;font-weight:600}
dl.facts dd{margin:0;overflow-wrap:anywhere}
.scroll{overflow-x:auto}
nav{margin:1em 0;font-size:.93em}nav a{margin-right:1.2em;color:var(--accent)}
figure{margin:1em 0}figure img{max-width:100%;height:auto;border:1px solid var(--line);border-radius:4px}
figcaption{color:var(--muted);font-size:.92em;max-width:72em;margin-top:.3em}
table{border-collapse:collapse;margin:.6em 0;font-size:.93em}
th,td{padding:3px 9px;border-bottom:1px solid var(--line);text-align:right;white-space:nowrap}
th{background:#f7f8fa;font-weight:600;vertical-align:bottom}
th[data-col]{cursor:pointer}th[aria-sort=ascending]::after{content:" ▲"}
th[aria-sort=descending]::after{content:" ▼"}
td.label,th.label{text-align:left}
tr.ref td{background:var(--ref);color:var(--muted);font-style:italic}
td.best{background:var(--best);font-weight:700}
.badge{display:inline-block;font-size:.75em;font-style:normal;padding:0 .45em;margin-left:.4em;border-radius:8px;
 border:1px solid var(--line);color:var(--muted);vertical-align:1px}
.badge.paper{border-color:#9bb8db;color:var(--accent)}
caption{caption-side:top;text-align:left;color:var(--muted);padding:.2em 0}
dl.legend{margin:.4em 0}dl.legend dt{font-weight:600;float:left;clear:left;min-width:9em}
dl.legend dd{margin:0 0 .25em 10em}
.numbers{display:flex;flex-wrap:wrap;gap:1em;margin:.6em 0}
.number{border:1px solid var(--line);border-radius:6px;padding:.5em .9em;min-width:12em}
.number b{display:block;font-size:1.35em}.number span{color:var(--muted);font-size:.88em}
footer{margin-top:2.5em;color:var(--muted);font-size:.85em;border-top:1px solid var(--line);padding-top:.6em}
details{margin:.5em 0}summary{cursor:pointer;color:var(--accent)}
"""

#: click a header (or press Enter on it) to sort its table by that column; reference rows stay on top
SORT_SCRIPT = """
document.querySelectorAll("table.sortable").forEach(function (t) {
  t.querySelectorAll("th[data-col]").forEach(function (th) {
    th.tabIndex = 0;
    function sort() {
      var i = +th.dataset.col, body = t.tBodies[0], asc = th.getAttribute("aria-sort") !== "ascending";
      var rows = Array.prototype.slice.call(body.rows);
      var key = function (r) { var v = r.cells[i].dataset.v; return v === undefined ? "" : v; };
      var cmp = function (a, b) {
        var x = key(a), y = key(b);
        if (x === "" || y === "") { return (x === "") - (y === ""); }
        var p = parseFloat(x), q = parseFloat(y);
        var c = (isNaN(p) || isNaN(q)) ? x.localeCompare(y) : p - q;
        return asc ? c : -c;
      };
      var pinned = rows.filter(function (r) { return r.classList.contains("ref"); });
      var rest = rows.filter(function (r) { return !r.classList.contains("ref"); }).sort(cmp);
      pinned.concat(rest).forEach(function (r) { body.appendChild(r); });
      t.querySelectorAll("th[data-col]").forEach(function (h) { h.removeAttribute("aria-sort"); });
      th.setAttribute("aria-sort", asc ? "ascending" : "descending");
    }
    th.addEventListener("click", sort);
    th.addEventListener("keydown", function (e) { if (e.key === "Enter") { sort(); } });
  });
});
"""


def esc(text: object) -> str:
    """HTML-escape any value's text."""
    return html.escape(str(text), quote=True)


def anchor(text: str) -> str:
    """An id made of the text's letters and digits (``Budget curves`` -> ``budget-curves``)."""
    return "-".join("".join(ch if ch.isalnum() else " " for ch in text.lower()).split()) or "section"


def figure_html(image: str | os.PathLike | bytes, caption: str, alt: str) -> str:
    """A figure with its PNG embedded as base64 and a caption saying how to read it."""
    data = image if isinstance(image, bytes) else Path(image).read_bytes()
    if not data.startswith(b"\x89PNG"):
        raise ValueError(f"{image if not isinstance(image, bytes) else 'image'}: not a PNG")
    src = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
    return (f'<figure><img src="{src}" alt="{esc(alt)}" loading="lazy">'
            f"<figcaption>{esc(caption)}</figcaption></figure>")


def numbers_html(items: Iterable[tuple[str, str, str]]) -> str:
    """Headline numbers: (value, what it is, what to compare it with) boxes."""
    boxes = "".join(f'<div class="number"><b>{esc(v)}</b>{esc(what)}<br><span>{esc(note)}</span></div>'
                    for v, what, note in items)
    return f'<div class="numbers">{boxes}</div>'


def legend_html(items: Iterable[tuple[str, str]]) -> str:
    """A definition list: (term, what it means)."""
    return '<dl class="legend">' + "".join(f"<dt>{esc(t)}</dt><dd>{esc(d)}</dd>" for t, d in items) + "</dl>"


def metric_legend_items(columns: Sequence[Column]) -> list[tuple[str, str]]:
    """Legend entries of summary columns, from their one definition in `sim.replay.metrics`."""
    return [(c.short, f"{c.label} ({c.direction} is better {c.arrow}): {c.doc}") for c in columns]


def _value_cell(value: float, best: bool = False, title: str = "") -> str:
    v = "" if value != value else repr(float(value))           # NaN sorts last
    text = fmt3(value)
    cls = ' class="best"' if best else ""
    tip = f' title="{esc(title)}"' if title else ""
    return f'<td data-v="{v}"{cls}{tip}>' + (f"<b>{text}</b>" if best else text) + "</td>"


def label_cell(label: str, role: str) -> str:
    """The policy's name, with a badge for a reference or a paper policy."""
    badge = {"reference": ' <span class="badge">reference</span>',       # the space: readable without CSS
             "paper": ' <span class="badge paper">paper</span>'}.get(role, "")
    return f'<td class="label" data-v="{esc(label)}">{esc(label)}{badge}</td>'


def ranked_table_html(table: RankedTable, caption: str = "") -> str:
    """A `RankedTable` as a sortable HTML table: rank, policy, the ranking metric per budget (grouped under one
    header) and its mean, then the other means; references shaded, the best cell per budget marked."""
    m = table.metric
    per_budget = [c for c in table.columns if c.budget is not None]
    rest = [c for c in table.columns if c.budget is None]
    head1 = ['<th rowspan="2" data-col="0">rank</th>', '<th rowspan="2" class="label" data-col="1">policy</th>']
    if per_budget:
        head1.append(f'<th colspan="{len(per_budget)}" title="{esc(m.doc)}">{esc(m.short)} {m.arrow} at budget '
                     "(slots per KV head and layer)</th>")
    for j, c in enumerate(rest, start=2 + len(per_budget)):
        name = f"{c.metric.short} {c.metric.arrow}" + (" mean" if c.metric.key == m.key else " (mean)")
        head1.append(f'<th rowspan="2" data-col="{j}" title="{esc(c.metric.doc)}">{esc(name)}</th>')
    head2 = [f'<th data-col="{j}">{esc(c.header)}</th>' for j, c in enumerate(per_budget, start=2)]
    body = []
    for r in table.rows:
        ref = r.role == "reference"
        cells = ['<td data-v="">ref</td>' if ref else _value_cell(r.rank), label_cell(r.label, r.role)]
        cells += [_value_cell(v, b, f"best at budget {c.budget}" if b and c.budget is not None else "")
                  for c, v, b in zip(table.columns, r.values, r.best)]
        body.append(('<tr class="ref">' if ref else "<tr>") + "".join(cells) + "</tr>")
    cap = f"<caption>{esc(caption)}</caption>" if caption else ""
    return (f'<div class="scroll"><table class="sortable ranked">{cap}<thead><tr>{"".join(head1)}</tr>'
            f'<tr>{"".join(head2)}</tr></thead><tbody>{"".join(body)}</tbody></table></div>')


def ranked_legend_items(table: RankedTable) -> list[tuple[str, str]]:
    """The legend of a ranked table: its metrics (from `sim.replay.metrics`), the rank, and the marks."""
    return legend_items(table) + [
        ("reference", ROLE_DOCS["reference"]), ("paper", ROLE_DOCS["paper"]), ("bold, green", ROLE_DOCS["best"]),
        ("—", "not run at that budget (below the policy's minimum budget)")]


def simple_table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, caption: str = "",
                 sortable: bool = True, label_columns: int = 1, best: Iterable[tuple[int, int]] = ()) -> str:
    """A plain table; floats are written with `fmt3` (and sort by value), ints in full, other cells as text;
    ``best`` holds the (row, column) cells to mark as the best of their column."""
    best = set(best)
    head = "".join("<th" + (' class="label"' if j < label_columns else "") + (f' data-col="{j}"' if sortable else "")
                   + f">{esc(h)}</th>" for j, h in enumerate(headers))
    body = []
    for i, row in enumerate(rows):
        cells = []
        for j, v in enumerate(row):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                cells.append(_value_cell(float(v), (i, j) in best) if isinstance(v, float)
                             else f'<td data-v="{v}">{v:,}</td>')
            else:
                cls = ' class="label"' if j < label_columns else ""
                cells.append(f'<td{cls} data-v="{esc(v)}">{esc(v)}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    cap = f"<caption>{esc(caption)}</caption>" if caption else ""
    cls = "sortable" if sortable else "plain"
    return (f'<div class="scroll"><table class="{cls}">{cap}<thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>')


@dataclass
class Page:
    """One result page: a title, a lede (one sentence: what this is), facts (the header), and sections."""

    title: str
    lede: str = ""
    facts: list[tuple[str, str, str]] = field(default_factory=list)
    sections: list[tuple[str, str]] = field(default_factory=list)

    def fact(self, key: str, label: str, value: object) -> "Page":
        """A header fact (``key`` marks it for tests and scripts: ``data-fact="model"``)."""
        self.facts.append((key, label, str(value)))
        return self

    def section(self, heading: str, body: str) -> "Page":
        """A section: its heading and its HTML body (already escaped)."""
        self.sections.append((heading, body))
        return self

    def render(self) -> str:
        """The whole page as one HTML string."""
        facts = "".join(f'<div data-fact="{esc(k)}"><dt>{esc(label)}</dt><dd>{esc(v)}</dd></div>'
                        for k, label, v in self.facts)
        nav = "".join(f'<a href="#{anchor(h)}">{esc(h)}</a>' for h, _ in self.sections)
        body = "".join(f'<section id="{anchor(h)}"><h2>{esc(h)}</h2>{b}</section>' for h, b in self.sections)
        return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                '<meta name="viewport" content="width=device-width, initial-scale=1">'
                f"<title>{esc(self.title)}</title><style>{CSS}</style></head><body>"
                f"<header><h1>{esc(self.title)}</h1>" + (f'<p class="lede">{esc(self.lede)}</p>' if self.lede else "")
                + f'<dl class="facts">{facts}</dl></header><nav>{nav}</nav><main>{body}</main>'
                f"<footer>Written by kvsim {esc(kvsim_version())} on {esc(now())}. This page is self-contained: its "
                "images are embedded and it loads nothing from the network. Click a column header to sort a table."
                f"</footer><script>{SORT_SCRIPT}</script></body></html>\n")

    def write(self, path: str | os.PathLike) -> Path:
        """Write the page atomically (temp file + rename) and return its path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".page-", suffix=".html", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self.render())
            os.chmod(tmp, 0o666 & ~current_umask())       # mkstemp creates 0600; a page is meant to be shared
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
        return path
