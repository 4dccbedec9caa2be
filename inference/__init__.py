"""Verifiers (pure functions), trees, proposers, the speculative generation loop."""
