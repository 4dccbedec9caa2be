"""Which kind of drafter a folder holds, read from its config.json (architectures / model_type)."""

from __future__ import annotations

from typing import Optional

from specdrafter.models.eagle import EAGLE1_ARCH, eagle3_layout
from specdrafter.models.medusa import medusa_layout

KIND_NAMES = {"eagle3": "an EAGLE-3 head", "eagle1": "an EAGLE-1 head", "medusa": "Medusa heads",
              "draft_model": "a draft model"}


def drafter_kind_of(config: dict) -> Optional[str]:
    """The drafter kind a config.json describes (None: not recognised)."""
    archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    archs = [a for a in archs if isinstance(a, str)]
    if eagle3_layout(config):  # ours, and the layouts SpecForge, the EAGLE repo and speculators write
        return "eagle3"
    if EAGLE1_ARCH in archs:
        return "eagle1"
    if medusa_layout(config):
        return "medusa"
    return "draft_model" if any(a.endswith("ForCausalLM") for a in archs) else None
