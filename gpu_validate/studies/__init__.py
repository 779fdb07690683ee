"""Studies that put the simulator beside the model: fidelity, needle / RULER retrieval and the recommendation."""
