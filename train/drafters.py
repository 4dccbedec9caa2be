"""The three trainable drafters. Each is a plain builder plus two functions the loop calls:

    predictions(module, batch, target) → [Prediction]   what the drafter predicts, aligned with the target
    save(module, folder, tokenizer)                      an HF-loadable folder the inference module decodes with

A Prediction pairs draft logits at position t with the target's logits at the position that predicts the same
token, so one loss (`train.objectives.distill_loss`) and one metric (`acceptance_metrics`) serve every kind.
With lead s, draft position t predicts x_{t+s}: it is compared with the target's row t+s−1 and counted where
x_{t+s} is target-generated (loss_mask). Draft model: s = 1. Medusa head h: s = h + 2. EAGLE step j: s = j + 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch
from omegaconf import DictConfig
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from data.features import capture_features, check_layer_ids
from data.io import SpecdrafterError, publish_dir, temp_dir_beside
from inference.eagle import Eagle3Head, eagle3_config, save_eagle3
from inference.medusa import MedusaHeads, init_from_target, medusa_config, save_medusa
from train.batches import Batch
from train.eagle import build_draft_vocab, training_time_test


@dataclass
class Prediction:
    name: str  # e.g. "head1", "step0", "draft"
    weight: float  # its share of the loss
    draft_logits: torch.Tensor  # [B, T', Vd]
    target_logits: torch.Tensor  # [B, T', V] the target's rows for the same tokens (detached)
    mask: torch.Tensor  # [B, T'] positions that count
    draft_ids: Optional[torch.Tensor] = None  # [Vd] target id of each draft-vocabulary entry (None: full vocabulary)


def aligned(name: str, weight: float, draft_logits, target_logits, loss_mask, lead: int, draft_ids=None) -> Prediction:
    T = loss_mask.shape[1]
    return Prediction(name, weight, draft_logits[:, :T - lead], target_logits[:, lead - 1:T - 1], loss_mask[:, lead:],
                      draft_ids)


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [B, T, V]
    features: Dict[int, torch.Tensor]  # {layer id: [B, T, d]}


@torch.no_grad()
def run_target(target: nn.Module, batch: Batch, layers: List[int]) -> TargetOutput:
    """The frozen target's logits and features for a batch: computed now (online) or from the data job's
    cache (offline: batch.features holds the cached layers, including the last layer's output)."""
    if batch.features is not None:
        L = target.config.num_hidden_layers
        features = {k: v.to(target.dtype) for k, v in batch.features.items()}
        return TargetOutput(target.lm_head(target.model.norm(features[L])).float(), features)  # [B, T, V]
    with capture_features(target, layers) as captured:
        logits = target(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()  # [B, T, V]
    return TargetOutput(logits, dict(captured))


# ------------------------------------------------------------------------------------------ draft model
def draft_model_from_target(target: nn.Module, num_layers: int) -> nn.Module:
    """A small causal LM initialised as a copy of the target's embeddings, first `num_layers` decoder layers,
    final norm and lm_head (trainable, not shared)."""
    config = AutoConfig.for_model(**{**target.config.to_dict(), "num_hidden_layers": num_layers})
    draft = AutoModelForCausalLM.from_config(config).to(target.dtype)
    wanted = draft.state_dict().keys()
    missing, _ = draft.load_state_dict({k: v.clone() for k, v in target.state_dict().items() if k in wanted}, strict=False)
    if missing:
        raise SpecdrafterError(f"could not initialise the draft model from the target: no weights for {missing[0]}")
    draft.generation_config = target.generation_config
    return draft


class DraftModelDrafter:
    kind = "draft_model"

    def __init__(self, cfg: DictConfig, target: nn.Module, data=None):
        dr = cfg.drafter
        if dr.path:
            module = AutoModelForCausalLM.from_pretrained(dr.path, dtype=target.dtype)
            if module.config.vocab_size != target.config.vocab_size:
                raise SpecdrafterError(f"draft model {dr.path!r} has a vocabulary of {module.config.vocab_size} tokens, "
                                       f"the target {target.config.vocab_size}: it must share the target's tokenizer")
        else:
            if not 1 <= dr.num_layers <= target.config.num_hidden_layers:
                raise SpecdrafterError(f"recipe key 'drafter.num_layers' must be in 1..{target.config.num_hidden_layers}, got {dr.num_layers}")
            module = draft_model_from_target(target, dr.num_layers)
        self.lora = None
        if dr.lora.r > 0:
            self.lora = LoraConfig(r=dr.lora.r, lora_alpha=dr.lora.alpha, lora_dropout=dr.lora.dropout,
                                   target_modules=list(dr.lora.target_modules), task_type="CAUSAL_LM")
            module = get_peft_model(module, self.lora)
        self.module, self.config = module, module.config
        self.prediction_names = ["draft"]

    def predictions(self, module, batch: Batch, target: TargetOutput) -> List[Prediction]:
        logits = module(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # [B, T, V]
        return [aligned("draft", 1.0, logits, target.logits, batch.loss_mask, lead=1)]

    def save(self, module, folder: Path, tokenizer) -> None:
        fresh = AutoModelForCausalLM.from_config(self.config)
        if self.lora is not None:  # merge the adapter into a fresh copy, so the export is a plain causal LM
            fresh = get_peft_model(fresh, self.lora)
            fresh.load_state_dict(module.state_dict())
            fresh = fresh.merge_and_unload()
        else:
            fresh.load_state_dict(module.state_dict())
        fresh.generation_config = module.generation_config
        tmp = temp_dir_beside(folder)
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        publish_dir(tmp, folder)


# ---------------------------------------------------------------------------------------------- Medusa
class MedusaDrafter:
    kind = "medusa"

    def __init__(self, cfg: DictConfig, target: nn.Module, data=None):
        m = cfg.drafter.medusa
        self.module = init_from_target(MedusaHeads(medusa_config(target.config, m.num_heads, m.num_layers)), target)
        self.module.to(target.dtype)
        self.norm = target.model.norm  # the heads read the normed last hidden state
        self.decay = m.decay
        self.last_layer = target.config.num_hidden_layers
        self.prediction_names = [f"head{h + 1}" for h in range(m.num_heads)]

    def predictions(self, module, batch: Batch, target: TargetOutput) -> List[Prediction]:
        L = self.last_layer
        logits = module(self.norm(target.features[L]))  # [H, B, T, V]
        return [aligned(f"head{h + 1}", self.decay ** h, logits[h], target.logits, batch.loss_mask, lead=h + 2)
                for h in range(logits.shape[0])]

    def save(self, module, folder: Path, tokenizer) -> None:
        save_medusa(module, folder)


# ----------------------------------------------------------------------------------------------- EAGLE-3
def default_aux_layers(num_layers: int) -> List[int]:
    return [2, num_layers // 2, num_layers - 3]  # low, middle, high (EAGLE-3)


class Eagle3Drafter:
    kind = "eagle3"

    def __init__(self, cfg: DictConfig, target: nn.Module, data=None):
        e = cfg.drafter.eagle
        L, V = target.config.num_hidden_layers, target.config.vocab_size
        aux = list(e.aux_layer_ids) or default_aux_layers(L)
        check_layer_ids(target, aux, "drafter.eagle.aux_layer_ids")
        if e.draft_vocab_size > V:
            raise SpecdrafterError(f"recipe key 'drafter.eagle.draft_vocab_size' ({e.draft_vocab_size}) exceeds the "
                                   f"target's vocabulary of {V} tokens")
        vocab = e.draft_vocab_size or V
        head = Eagle3Head(eagle3_config(target.config, aux, vocab)).to(target.dtype)
        if vocab < V and data is not None:
            d2t, t2d = build_draft_vocab(data.target_tokens(), V, vocab)
            head.d2t.copy_(d2t)
            head.t2d.copy_(t2d)
        elif vocab == V:
            head.t2d.fill_(True)
        with torch.no_grad():  # start the pruned lm_head from the target's rows for the same tokens
            head.lm_head.weight.copy_(target.lm_head.weight[head.draft_ids])
        self.module, self.embed = head, target.get_input_embeddings()
        self.steps, self.decay = e.ttt_steps, e.step_decay
        self.prediction_names = [f"step{j}" for j in range(self.steps)]

    def predictions(self, module, batch: Batch, target: TargetOutput) -> List[Prediction]:
        fused = module.fuse(target.features)  # [B, T, d]
        steps = training_time_test(module, self.embed, fused, batch.input_ids, self.steps)
        draft_ids = module.draft_ids
        in_vocab = module.t2d[target.logits.argmax(-1)]  # [B, T] positions whose target argmax the draft can emit
        out = []
        for j, step in enumerate(steps):
            p = aligned(f"step{j}", self.decay ** j, step.logits, target.logits, batch.loss_mask, lead=j + 2,
                        draft_ids=draft_ids)
            p.loss_mask = p.mask * in_vocab[:, j + 1:in_vocab.shape[1] - 1]  # out-of-vocabulary targets are not trained on
            out.append(p)
        return out

    def save(self, module, folder: Path, tokenizer) -> None:
        save_eagle3(module, folder)


def needed_layers(cfg: DictConfig, target_config) -> List[int]:
    """Target layers the drafter reads (ids as in data/features.py). The last layer's output is always among
    them: from it offline mode rebuilds the target's logits."""
    L = target_config.num_hidden_layers
    if cfg.drafter.kind.value == "eagle3":
        return sorted(set(cfg.drafter.eagle.aux_layer_ids or default_aux_layers(L)) | {L})
    return [L]


DRAFTERS = {"draft_model": DraftModelDrafter, "medusa": MedusaDrafter, "eagle3": Eagle3Drafter}


def build_drafter(cfg: DictConfig, target: nn.Module, data=None):
    kind = cfg.drafter.kind.value
    if kind not in DRAFTERS:
        raise SpecdrafterError(f"recipe key 'drafter.kind': {kind} is not trainable (valid: {', '.join(DRAFTERS)})")
    return DRAFTERS[kind](cfg, target, data)
