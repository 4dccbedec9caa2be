"""Target features: the hidden states EAGLE and Medusa heads read, captured during an ordinary forward pass.

Layer-id convention (vLLM's): id k is the *input* to decoder layer k, so id 0 is the token embedding; id L
(= num_hidden_layers) is the output of the last layer *before* the final norm — the input to `model.norm`.
SGLang has read aux ids as layer outputs (id + 1 in this convention); exports record which one they use.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, Sequence

import torch
from torch import nn

from specdrafter.core.io import SpecdrafterError


def check_layer_ids(model: nn.Module, layer_ids: Sequence[int], key: str) -> None:
    num_layers = model.config.num_hidden_layers
    bad = next((k for k in layer_ids if not 0 <= k <= num_layers), None)
    if bad is not None:
        raise SpecdrafterError(f"recipe key {key!r}: layer id {bad} is out of range for a target with {num_layers} "
                               f"layers (valid: 0..{num_layers}; id k = input to layer k, {num_layers} = last layer's output)")


@contextmanager
def capture_features(model: nn.Module, layer_ids: Sequence[int]) -> Iterator[Dict[int, torch.Tensor]]:
    """Within the block, every forward pass of `model` (an HF causal LM) stores the hidden states of
    `layer_ids` in the yielded dict, {k: [B, T, d]}, overwriting the previous pass's."""
    layers, captured = model.model.layers, {}
    modules = {k: layers[k] if k < len(layers) else model.model.norm for k in layer_ids}

    def hook(k):
        def store(module, args, kwargs):
            captured[k] = args[0] if args else kwargs["hidden_states"]  # [B, T, d]
        return store

    handles = [module.register_forward_pre_hook(hook(k), with_kwargs=True) for k, module in modules.items()]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()
