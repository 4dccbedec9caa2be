"""Drafter architectures — EAGLE-1/3 heads, Medusa heads — and the target-feature hooks they read; training (train/)
and decoding (inference/) both import them from here."""
