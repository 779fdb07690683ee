"""What every study page shares: the facts a page's header ends with (`run_facts`, from the `run_info` a result's
JSON records), the glossary of the terms the pages weigh numbers with (`TERMS`) and a confusion matrix
(`confusion_html`).

Each study's page lives in its study package (`gpu_validate.studies.fidelity.fidelity_page`,
`gpu_validate.studies.needle.needle_page`, `gpu_validate.studies.recommendation.recommend_page`), built from the
result's JSON alone (plus its PNG), so a stored result can be paged again. Every number a reader should weigh sits
next to what it is weighed against: the simulator's rho beside the model's own reliability (how well the model
agrees with itself), an agreement beside its base rate (what always giving the commoner answer would score), with
balanced accuracy and Matthews correlation where the calls are yes/no (neither rewards the commoner answer), and
the confusion matrix of the calls behind the agreement. Tables per budget come from `sim.reports.table` (the
builder the terminal uses), page parts from `sim.reports.webpage`.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from sim.reports.runinfo import kvsim_version, machine, now
from sim.reports.table import fmt3
from sim.reports.webpage import Page, simple_table

#: the terms the pages weigh their numbers with: the glossary that ends every study page's legend
TERMS = {
    "Spearman ρ": "rank correlation of two lists (1: same order, 0: unrelated, −1: reversed)",
    "ρ over all": "Spearman ρ over every (policy, budget): dominated by the budget, which both sides order alike",
    "ρ within budget": "the mean over budgets of Spearman ρ among the lossy policies at one budget: does the "
                       "simulator rank the policies, not only the budgets?",
    "reliability": "how well the model agrees with itself: its policy ranking on one half of the data against the "
                   "other half (split-half Spearman ρ, stepped up to the whole by Spearman-Brown). A simulator "
                   "cannot be expected to predict the model better than the model predicts itself.",
    "pair agreement": "the share of pairs of policies at the same budget that the simulator orders as the model does",
    "base rate": "the agreement of always giving the commoner answer; an agreement is worth what it adds to this",
    "balanced accuracy": "the mean of the share of the model's hits the simulator calls hits and the share of its "
                         "misses it calls misses: 0.5 for any constant call, 1 for a perfect one, however unbalanced "
                         "the outcomes (— where the held-out cells hold one outcome only)",
    "MCC": "Matthews correlation of the simulator's calls with the model's outcomes: 1 perfect, 0 no better than "
           "chance or a constant call, −1 reversed; like balanced accuracy it does not reward calling the commoner "
           "outcome",
}



def _machine_text(value: Any) -> str:
    if isinstance(value, Mapping):
        parts = [str(value.get(k)) for k in ("platform", "processor") if value.get(k)]
        if value.get("cpu_count"):
            parts.append(f"{value['cpu_count']} cores")
        return ", ".join(parts) or "not recorded"
    return str(value) if value else "not recorded in this result"


def run_info() -> dict[str, str]:
    """kvsim version, date and machine of this run, for a result's JSON (the page states them)."""
    return {"kvsim": kvsim_version(), "date": now(), "machine": machine()}


def run_facts(page: Page, report: Mapping[str, Any], command: str | None) -> None:
    """The facts every page ends its header with: device, kvsim version, date and machine of the run."""
    if report.get("device"):
        page.fact("device", "device", f"{report['device']}, backend {report.get('backend', '?')}")
    page.fact("version", "kvsim", report.get("kvsim") or f"not recorded (page by kvsim {kvsim_version()})")
    page.fact("date", "date", report.get("date") or f"not recorded (page written {now()})")
    page.fact("machine", "machine", _machine_text(report.get("machine")))
    if report.get("seconds"):
        page.fact("seconds", "run time", f"{fmt3(float(report['seconds']) / 60)} min")
    if command or report.get("command"):
        page.fact("command", "command", command or report["command"])



def confusion_html(matrix: Mapping[str, Mapping[str, int]], rows: Sequence[tuple[str, str]],
                   cols: Sequence[tuple[str, str]], caption: str) -> str:
    """A 2 x 2 (or larger) confusion matrix: ``rows``/``cols`` are (key in ``matrix``, header) pairs; the
    diagonal (agreement) is marked."""
    body = [[head] + [int(matrix[rk][ck]) for ck, _ in cols] for rk, head in rows]
    html = simple_table(["", *[h for _, h in cols]], body, caption=caption, sortable=False)
    return html

