"""Fidelity: do the simulator's losses rank policies and budgets as the model's do?"""
