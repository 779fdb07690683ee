"""mkdocs hook: the figures and HTML result pages the benchmarks write (``benchmarks/results/*.png|html``) are
served at ``results/files/NAME`` in the built site, so the documentation links them where they are, without a
copy in ``docs/``."""
from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def on_files(files: Files, config) -> Files:
    for path in sorted(RESULTS.glob("*")):
        if path.suffix in (".png", ".html"):
            files.append(File.generated(config, f"results/files/{path.name}", abs_src_path=str(path)))
    return files
