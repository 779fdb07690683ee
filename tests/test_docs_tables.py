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
