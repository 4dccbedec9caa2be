"""What every engine config of a drafter's decoder layer needs spelled out (export/formats.py, export/block.py)."""

from __future__ import annotations


def with_rope_keys(layer: dict, raw: dict) -> dict:
    """`layer` with `rope_theta` (and a non-default `rope_scaling`) from transformers 5's `rope_parameters` in `raw`
    spelled out beside it: engines read either, and one that finds no rope_theta silently falls back to its own
    default (10000 for a Llama layer, 10⁶ for vLLM's DFlash layer)."""
    layer = dict(layer)
    rope = raw.get("rope_parameters") or {}
    if "rope_theta" in rope:
        layer.setdefault("rope_theta", rope["rope_theta"])
    if rope.get("rope_type", "default") != "default":
        layer.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    return layer
