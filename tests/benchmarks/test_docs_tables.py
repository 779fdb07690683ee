"""benchmarks/docs_tables.py: the committed result pages are what the JSON gives, and --check notices a stale one."""
from __future__ import annotations

import math

from benchmarks import docs_tables


def test_committed_result_pages_are_current():
    stale = [p.name for p, text in docs_tables.render().items() if not p.exists() or p.read_text() != text]
    assert not stale, f"regenerate with python -m benchmarks.docs_tables: {stale}"


def test_check_fails_on_a_stale_page_and_passes_once_regenerated(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(docs_tables, "PAGES_DIR", tmp_path)
    assert docs_tables.main(["--check"]) == 1                      # nothing written yet
    assert docs_tables.main([]) == 0
    assert docs_tables.main(["--check"]) == 0
    page = tmp_path / "speed.md"
    page.write_text(page.read_text().replace("|", "!", 1))       # a hand edit
    capsys.readouterr()
    assert docs_tables.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "stale: " in err and "speed.md" in err and "policies.md" not in err


def test_cells_and_tables():
    assert docs_tables.fmt(None) == docs_tables.fmt(math.nan) == "—"
    assert docs_tables.fmt(0.123456) == "0.123" and docs_tables.fmt(12345.6) == "12 346"
    assert docs_tables.fmt(1234) == "1 234" and docs_tables.fmt(True) == "yes" and docs_tables.fmt("a|b") == "a\\|b"
    assert docs_tables.fmt(2.5e-5) == "2.50e-05"
    assert docs_tables.table(["a", "b"], [[1, 0.5]]) == "| a | b |\n|---|---|\n| 1 | 0.5 |\n"


def test_a_missing_result_says_which_benchmark_to_run(monkeypatch, tmp_path):
    monkeypatch.setattr(docs_tables, "RESULTS", tmp_path)
    text = docs_tables.kvpress_page()
    assert "kvpress_parity.json` is not there yet" in text


def test_claim_phrases_follow_the_numbers():
    assert docs_tables.span([23.7, 36.9]) == "24-37" and docs_tables.span([43.61, 43.64], 1) == "43.6"
    assert docs_tables.signed_span([-4.4, 2.8]) == "−4.4 to +2.8"
    assert docs_tables.against([2, 3], [1, 1], ["64", "128"], "H2O") == "error above H2O's at every budget"
    assert docs_tables.against([1, 3], [2, 1], ["5", "30"], "H2O", suffix="%") == \
        "error below H2O's at 5%, above at 30%"
    assert docs_tables.lower_than([0.9, 0.8, 1.1], [1.0, 1.0, 1.0], [256, 512, 2048], " on M") == \
        "10-20% lower on M at 256-512 (higher at 2 048)"
    assert docs_tables.direction([0.2, 0.4], [0.2, 0.3]) == "above"
    assert docs_tables.direction([0.1, 0.4], [0.2, 0.3]) == "mixed against"
    assert docs_tables.on_models({"A": "x", "B": "x"}) == "x on both models"


def test_a_claim_without_its_json_says_which_instead_of_numbers(monkeypatch, tmp_path):
    monkeypatch.setattr(docs_tables, "RESULTS", tmp_path)
    text = docs_tables.papers_page()
    assert text.count("*not there yet:") == len(docs_tables.CLAIMS)
    assert "`eval_cascading.json`" in text and "ruler_bumblebee_gemma3-270m.json` is not there yet" in text
