"""The cost model as it was before issue 15 (reference for equivalence tests)."""
