"""Replay engine, metrics, sweeps, serving simulation and the kvsim CLI."""
