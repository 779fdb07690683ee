"""The simulator: replay policies on recorded traces, run many configurations, report the results.

- ``sim.replay``: one policy over one trace at a budget (the numba engine, step plans, metrics, the oracle);
  many cells of one trace in one pass (``sim.replay.cells``).
- ``sim.experiments``: sweeps, hyperparameter search, fuzzing, the executors and the resumable results store.
- ``sim.reports``: ranked tables, plots and self-contained HTML pages.
- ``sim.serving``: what a policy's KV footprint buys a server in throughput and latency (discrete events).
- ``sim.commands`` and ``sim.cli``: the ``kvsim`` command line.
"""
