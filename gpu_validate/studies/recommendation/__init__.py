"""``kvsim recommend``: the candidates, the search, the guarantee and the page."""
