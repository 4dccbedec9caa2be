"""Medusa heads (docs/algorithms.md §Medusa): the model, its config and its folder.

Offsets. The heads read the target's last hidden state *after* the final norm (the input to its lm_head),
h_t at position t. The target's lm_head on h_t predicts x_{t+1}; Medusa head i (0-based) predicts x_{t+i+2}.
In the speculative loops the target cache holds every committed token but the newest, and target features
arrive for exactly those positions, so with n committed tokens the newest feature is at position n - 2: its
lm_head prediction is committed[-1] (already known) and head i drafts the token at position n + i, i.e.
draft token i + 1. A chain of k tokens uses heads 0..k-1; a tree node at depth d is a token of head d - 1.

Checkpoints use vLLM's Medusa layout (docs/formats.md §Medusa): config.json with `architectures: ["MedusaModel"]`,
`model_type: "medusa"`, `num_heads`, `num_hidden_layers` (ResBlocks per head), `hidden_size`, `vocab_size`,
`medusa_fc_bias`; weights `blocks.{i}.layers.{j}.weight/.bias` and `lm_heads.{i}.weight`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from specdrafter.core.io import SpecdrafterError
from specdrafter.core.weights import read_safetensors, save_config_and_weights


class MedusaConfig(PretrainedConfig):
    """The fields vLLM's MedusaConfig reads. `medusa_fc_bias` defaults to False as in vLLM, which silently
    drops ResBlock biases unless the config says they exist, so `medusa_config` always writes it."""
    model_type = "medusa"

    def __init__(self, num_heads: int = 5, num_hidden_layers: int = 1, hidden_size: int = 4096,
                 vocab_size: int = 32000, medusa_fc_bias: bool = False, **kwargs):
        kwargs.setdefault("architectures", ["MedusaModel"])
        self.num_heads, self.num_hidden_layers = num_heads, num_hidden_layers
        self.hidden_size, self.vocab_size, self.medusa_fc_bias = hidden_size, vocab_size, medusa_fc_bias
        super().__init__(**kwargs)


def medusa_config(target_config, num_heads: int, num_layers: int = 1,
                  base_model_name_or_path: str | None = None) -> MedusaConfig:
    """`num_heads` heads of `num_layers` ResBlocks each, sized for the target. Pass a hub name (never a local
    path) as `base_model_name_or_path`: it is written into the exported config."""
    if num_heads < 1 or num_layers < 0:
        raise SpecdrafterError(f"Medusa needs num_heads >= 1 and num_layers >= 0, got {num_heads}, {num_layers}")
    extra = {"base_model_name_or_path": base_model_name_or_path} if base_model_name_or_path else {}
    return MedusaConfig(num_heads=num_heads, num_hidden_layers=num_layers, hidden_size=target_config.hidden_size,
                        vocab_size=target_config.vocab_size, medusa_fc_bias=True, **extra)


class ResidualBlock(nn.Module):
    """x ← x + SiLU(W x + b), `num_layers` times."""

    def __init__(self, hidden_size: int, num_layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))  # [..., d]
        return x


class MedusaHeads(nn.Module):
    """H heads; head i maps the normed last hidden state h_t to logits for x_{t+i+2}."""

    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        d, V = config.hidden_size, config.vocab_size
        self.blocks = nn.ModuleList(ResidualBlock(d, config.num_hidden_layers, config.medusa_fc_bias)
                                    for _ in range(config.num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(d, V, bias=False) for _ in range(config.num_heads))

    @property
    def num_heads(self) -> int:
        return len(self.lm_heads)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] (after the target's final norm) → logits [H, ..., V]."""
        return torch.stack([head(block(hidden)) for block, head in zip(self.blocks, self.lm_heads)])


@torch.no_grad()
def init_from_target(heads: MedusaHeads, target) -> MedusaHeads:
    """Training start (Medusa): zero ResBlocks, so every head begins as a copy of the target's lm_head."""
    check_heads_fit(heads, target)
    for block in heads.blocks:
        for layer in block.layers:
            layer.weight.zero_()
            if layer.bias is not None:
                layer.bias.zero_()
    for head in heads.lm_heads:
        head.weight.copy_(target.get_output_embeddings().weight)
    return heads


def check_heads_fit(heads: MedusaHeads, target) -> None:
    t, c = target.config, heads.config
    if c.vocab_size != t.vocab_size:
        raise SpecdrafterError(f"Medusa heads' vocabulary ({c.vocab_size} tokens) differs from the target's ({t.vocab_size} "
                               "tokens)")
    if c.hidden_size != t.hidden_size:
        raise SpecdrafterError(f"Medusa heads read hidden size {c.hidden_size}, the target has {t.hidden_size}")


def save_medusa(heads: MedusaHeads, folder: str | Path) -> Path:
    """Write config.json + model.safetensors atomically (a temp folder renamed into place)."""
    return save_config_and_weights(heads, folder)


def medusa_layout(config: dict) -> Optional[str]:
    """The Medusa layout a config.json describes (None: not Medusa heads), named after the export that writes it:
    `medusa-vllm` (vLLM's MedusaModel, our native folder) or `medusa` (the Medusa repo's: medusa_num_heads,
    medusa_num_layers and medusa_lm_head.safetensors)."""
    archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    if config.get("model_type") == "medusa" or "MedusaModel" in archs:
        return "medusa-vllm"
    return "medusa" if "medusa_num_heads" in config else None


MEDUSA_REPO_WEIGHTS = "medusa_lm_head.safetensors"


def remap_medusa_repo_weights(weights: Dict[str, torch.Tensor], num_layers: int) -> Dict[str, torch.Tensor]:
    """The Medusa repo's head i, nn.Sequential(ResBlock × L, lm_head), under our names: `{i}.{j}.linear.*` (j < L)
    → blocks.{i}.layers.{j}.*, `{i}.{L}.weight` → lm_heads.{i}.weight. The repo repeats one ResBlock L times; L
    equal blocks compute the same. Other names keep theirs (load_medusa refuses them)."""
    ours = {}
    for name, tensor in weights.items():
        m = re.fullmatch(r"(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)", name)
        if m and m[3] == "weight" and int(m[2]) == num_layers:
            name = f"lm_heads.{m[1]}.weight"
        elif m and m[3] != "weight" and int(m[2]) < num_layers:
            name = f"blocks.{m[1]}.layers.{m[2]}.{m[3].split('.')[1]}"
        ours[name] = tensor
    return ours


def load_medusa(folder: str | Path, dtype: torch.dtype = torch.float32) -> MedusaHeads:
    """Medusa heads in either layout `medusa_layout` recognises (our native folder and both our exports)."""
    folder = Path(folder)
    try:
        raw = json.loads((folder / "config.json").read_text())
        layout = medusa_layout(raw) if isinstance(raw, dict) else None
        weights = read_safetensors(folder / (MEDUSA_REPO_WEIGHTS if layout == "medusa" else "model.safetensors"))
    except (OSError, ValueError) as e:
        raise SpecdrafterError(f"could not load the Medusa heads in {str(folder)!r}: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise SpecdrafterError(f"{str(folder / 'config.json')!r} holds a JSON {type(raw).__name__}, not an object")
    if layout is None:
        raise SpecdrafterError(f"{str(folder)!r} is not a Medusa checkpoint (model_type: {raw.get('model_type')!r})")
    if layout == "medusa":
        config = medusa_repo_config(raw, weights, folder)
        weights = remap_medusa_repo_weights(weights, config.num_hidden_layers)
    else:
        config = MedusaConfig.from_dict(raw)
    heads = MedusaHeads(config)
    try:
        heads.load_state_dict(weights)
    except RuntimeError as e:
        raise SpecdrafterError(f"Medusa weights in {str(folder)!r} do not match its config.json: "
                               f"{' '.join(str(e).split())[:300]}") from None
    return heads.to(dtype).eval()


def medusa_repo_config(raw: dict, weights: Dict[str, torch.Tensor], folder: Path) -> MedusaConfig:
    """Our config for a Medusa repo folder: its config names the head and ResBlock counts; the sizes come from
    head 0's lm_head, [V, d]. Its ResBlocks always have a bias (nn.Linear's default)."""
    H, L = raw.get("medusa_num_heads"), raw.get("medusa_num_layers", 1)
    if not (isinstance(H, int) and H >= 1 and isinstance(L, int) and L >= 0):
        raise SpecdrafterError(f"{str(folder / 'config.json')!r}: medusa_num_heads = {H!r}, medusa_num_layers = {L!r}; "
                               "expected whole numbers (heads >= 1)")
    lm_head = weights.get(f"0.{L}.weight")
    if lm_head is None or lm_head.dim() != 2:
        raise SpecdrafterError(f"Medusa weights in {str(folder / MEDUSA_REPO_WEIGHTS)!r} do not match its config.json: "
                               f"no lm_head 0.{L}.weight [vocab, hidden] for medusa_num_layers = {L}")
    V, d = lm_head.shape
    extra = {"base_model_name_or_path": raw["base_model_name_or_path"]} if raw.get("base_model_name_or_path") else {}
    return MedusaConfig(num_heads=H, num_hidden_layers=L, hidden_size=d, vocab_size=V, medusa_fc_bias=True, **extra)
