"""Which kind of drafter a folder holds, read from its config.json (architectures / model_type)."""

from __future__ import annotations

from typing import Optional

from specdrafter.models.eagle import EAGLE1_ARCH

KIND_NAMES = {"eagle3": "an EAGLE-3 head", "eagle1": "an EAGLE-1 head", "medusa": "Medusa heads",
              "draft_model": "a draft model"}


def drafter_kind_of(config: dict) -> Optional[str]:
    """The drafter kind a config.json describes (None: not recognised)."""
    archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    archs = [a for a in archs if isinstance(a, str)]
    if any("Eagle3" in a for a in archs):
        return "eagle3"
    if EAGLE1_ARCH in archs:
        return "eagle1"
    if config.get("model_type") == "medusa" or "MedusaModel" in archs:
        return "medusa"
    return "draft_model" if any(a.endswith("ForCausalLM") for a in archs) else None
