"""Needle-in-a-haystack and RULER-style retrieval: prompts, closed-loop runs, the simulator's prediction and its scores."""
