"""What a person reads: ranked tables, plots, self-contained HTML pages and the facts of a run."""
