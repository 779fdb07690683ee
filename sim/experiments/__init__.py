"""Experiments over many configurations: sweeps, searches, fuzzing, the executors they run on and the results store."""
