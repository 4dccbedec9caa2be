"""The trainable drafters (kinds/ builds them). Each is a plain builder plus two functions the loop calls:

    predictions(module, batch, target) → [Prediction]   what the drafter predicts, aligned with the target
    save(module, folder, tokenizer)                      an HF-loadable folder the inference module decodes with

A Prediction pairs draft logits at position t with the target's logits at the position that predicts the same
token, so one loss (`train.objectives.distill_loss`) and one metric (`jobs.train.acceptance_sums`) serve every
kind. With lead s, draft position t predicts x_{t+s}: it is compared with the target's row t+s−1, and only
positions where x_{t+s} is target-generated (loss_mask) are computed at all.
Draft model: s = 1. Medusa head h: s = h + 2. EAGLE-3 TTT step j: s = j + 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from omegaconf import DictConfig
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from specdrafter.core.io import SpecdrafterError, publish_dir, temp_dir_beside
from specdrafter.core.weights import check_model_folder, write_config_and_weights
from specdrafter.data.assets import resolve_target
from specdrafter.models.eagle import (
    EAGLE31_FLAGS,
    Eagle1Head,
    Eagle3Head,
    default_aux_layers,
    eagle1_config,
    eagle3_config,
    save_eagle3,
)
from specdrafter.models.features import capture_features
from specdrafter.models.medusa import MedusaHeads, init_from_target, medusa_config, save_medusa
from specdrafter.train.batches import Batch
from specdrafter.train.eagle import build_draft_vocab, shift_left, training_time_test
from specdrafter.train.memory import TEACHER_CHUNK
from specdrafter.train.narrow import narrowed
from specdrafter.train.objectives import Objective, feature_loss, masked_mean

# The dtype of every trainable drafter's weights, whatever the target's: AdamW on bf16 weights loses the updates
# smaller than bf16's resolution. train.precision=amp_bf16 runs the matmuls in bf16 under autocast; DeepSpeed's bf16
# mode casts the module itself and keeps fp32 master weights.
MASTER_DTYPE = torch.float32


@dataclass
class Prediction:
    name: str  # e.g. "head1", "step0", "draft"
    weight: float  # its share of the loss
    draft_logits: torch.Tensor  # [N, Vd] at the N counted positions
    target_logits: torch.Tensor  # [N, V] the target's rows for the same tokens (no gradient)
    draft_ids: Optional[torch.Tensor] = None  # [Vd] target id of each draft-vocabulary entry (None: full vocabulary)
    loss_rows: Optional[torch.Tensor] = None  # [N] bool: rows the loss uses (None: all; metrics always use all)
    feature_loss: Optional[torch.Tensor] = None  # EAGLE-1's feature regression, weighted, added to the loss as is
    confidence_loss: Optional[torch.Tensor] = None  # DSpark's confidence head BCE, weighted, added to the loss as is
    selector_loss: Optional[torch.Tensor] = None  # DFlash2's candidate selector CE, weighted, added to the loss as is
    # When set, target_logits hold only the draft vocabulary's rows [N, Vd] and target_lse [N] is the log of the
    # target's normaliser over its *full* vocabulary at the training temperature (see `teacher_rows`).
    target_lse: Optional[torch.Tensor] = None
    # [N] a weight per row (D-PACE's, detached): the loss is the masked mean of weight · objective; None: all 1
    row_weights: Optional[torch.Tensor] = None

    def loss(self, objective: Objective) -> Tuple[torch.Tensor, torch.Tensor]:
        """This prediction's training loss — (weight · objective + its extra terms, the objective alone):
        the target's rows sliced to the draft vocabulary (unless `teacher_rows` already did), `objective` (the
        recipe's: train/objectives.py:Objective.of) over the `loss_rows`, times `weight` (1 for a draft model;
        Medusa head i: heads_weight · decay^i; EAGLE TTT step j: step_decay^j, 0.8^j by default), each row
        times its `row_weights` when set (a block drafter's D-PACE); the second value is always unweighted."""
        sliced = self.draft_ids is None or self.target_lse is not None  # target rows already in the draft vocabulary
        teacher = self.target_logits if sliced else self.target_logits[:, self.draft_ids]  # [N, Vd]
        rows = self.loss_rows
        if rows is None:
            rows = torch.ones(len(teacher), dtype=torch.bool, device=teacher.device)  # [N]
        extra = sum(term for term in (self.feature_loss, self.confidence_loss, self.selector_loss) if term is not None)
        if self.row_weights is None:
            value = objective(teacher, self.draft_logits, rows)
            return self.weight * value + extra, value
        per_row = objective.per_row(teacher, self.draft_logits)  # [N]
        weighted = masked_mean(per_row * self.row_weights, rows)
        return self.weight * weighted + extra, masked_mean(per_row, rows)


@dataclass
class TargetOutput:
    features: Dict[int, torch.Tensor]  # {layer id: [B, T, d]}
    # [R, V] (or [R, Vd]: draft vocabulary only) the target's logits at the rows that predict a target-generated token
    logits: torch.Tensor
    row_index: torch.Tensor  # [B, T] index into `logits` (−1 elsewhere)
    lse: Optional[torch.Tensor] = None  # [R] with draft-vocabulary logits: log Σ_v exp(z_v / T) over the full vocabulary
    top_in_vocab: Optional[torch.Tensor] = None  # [R] bool: the target's top token is in the draft vocabulary

    def rows(self, rows, lead: int) -> torch.Tensor:
        """Indices into `logits` of the target's rows for the tokens that draft positions `rows` predict with lead s:
        row t+s−1."""
        b, t = rows
        return self.row_index[b, t + lead - 1]


def counted_rows(loss_mask: torch.Tensor, lead: int):
    """(batch, position) of every draft position t whose predicted token x_{t+lead} is target-generated."""
    return loss_mask[:, lead:].bool().nonzero(as_tuple=True)


def target_rows(target: TargetOutput, rows, lead: int) -> torch.Tensor:
    """The target's logits [N, V] for the token that draft position t predicts with lead s: row t+s−1."""
    return target.logits[target.rows(rows, lead)]


@torch.no_grad()
def teacher_rows(hidden: torch.Tensor, lm_head: torch.Tensor, draft_ids: torch.Tensor, temperature: float):
    """The target's teacher over a draft vocabulary without a [R, V] tensor: hidden [R, d] (after the final norm),
    lm_head [V, d], draft_ids [Vd]. The full vocabulary is visited TEACHER_CHUNK rows at a time for its
    log-normaliser at `temperature` and its maximum; only the draft vocabulary's logits are kept.
    Returns (logits [R, Vd] fp32, lse [R], top_in_vocab [R] bool: the target's top token is a draft token)."""
    lse = hidden.new_full((len(hidden),), float("-inf"), dtype=torch.float32)  # [R]
    best = lse.clone()  # [R]
    for chunk in lm_head.split(TEACHER_CHUNK):
        z = (hidden @ chunk.T).float()  # [R, C]
        lse = torch.logaddexp(lse, torch.logsumexp(z / temperature, dim=-1))
        best = torch.maximum(best, z.max(-1).values)
    logits = (hidden @ lm_head[draft_ids].T).float()  # [R, Vd]
    return logits, lse, logits.max(-1).values >= best


@torch.no_grad()
def run_target(target: nn.Module, batch: Batch, layers: List[int], draft_ids: Optional[torch.Tensor] = None,
               temperature: float = 1.0, dtype: Optional[torch.dtype] = None) -> TargetOutput:
    """The frozen target's features and logits for a batch: computed now (online) or from the data job's cache
    (offline: batch.features holds the cached layers, including the last layer's output). The lm_head — a
    large share of the target's cost — runs only at the rows whose next token carries loss; with `draft_ids`
    only the draft vocabulary's logits are kept (`teacher_rows`: memory O(R · Vd), not O(R · V)). The features are
    handed to the drafter in `dtype` (its weights' dtype; default: the target's)."""
    L = target.config.num_hidden_layers
    if batch.features is not None:
        features = {k: v.to(target.dtype) for k, v in batch.features.items()}
    else:
        with capture_features(target, layers) as captured:
            target.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)  # the backbone only
        features = dict(captured)
    b, t = counted_rows(batch.loss_mask, 1)
    row_index = torch.full(batch.input_ids.shape, -1, dtype=torch.long, device=batch.input_ids.device)
    row_index[b, t] = torch.arange(len(b), device=b.device)
    hidden = target.model.norm(features[L][b, t])  # [R, d]
    if dtype is not None:
        features = {k: v.to(dtype) for k, v in features.items()}
    if draft_ids is None:
        return TargetOutput(features, target.lm_head(hidden).float(), row_index)  # [R, V]
    logits, lse, top_in_vocab = teacher_rows(hidden, target.lm_head.weight, draft_ids.to(hidden.device), temperature)
    return TargetOutput(features, logits, row_index, lse, top_in_vocab)


# ------------------------------------------------------------------------------------------ draft model
PER_LAYER_KEYS = ("layer_types", "no_rope_layers")  # config lists with one entry per decoder layer


def cut_config(config, layers: Sequence[int]):
    """`config` for a model of the decoder layers `layers` only (in that order, each keeping its own attention type:
    `PER_LAYER_KEYS`)."""
    facts = config.to_dict()
    per_layer = {k: [facts[k][i] for i in layers] for k in PER_LAYER_KEYS if isinstance(facts.get(k), list)}
    return AutoConfig.for_model(**{**facts, "num_hidden_layers": len(layers), **per_layer})


def draft_model_from_target(target: nn.Module, layers: Sequence[int]) -> nn.Module:
    """A small causal LM initialised as a copy of the target's embeddings, the decoder layers `layers` (in that
    order, each keeping its own attention type: `PER_LAYER_KEYS`), final norm and lm_head (trainable, not shared)."""
    draft = AutoModelForCausalLM.from_config(cut_config(target.config, layers)).to(MASTER_DTYPE)
    source = {f"model.layers.{i}.": f"model.layers.{j}." for i, j in enumerate(layers)}  # draft prefix → target's
    weights = {}
    for key in draft.state_dict():
        prefix = next((p for p in source if key.startswith(p)), None)
        weights[key] = target.state_dict()[source[prefix] + key[len(prefix):] if prefix else key].clone()
    missing, _ = draft.load_state_dict(weights, strict=False)
    if missing:
        raise SpecdrafterError(f"could not initialise the draft model from the target: no weights for {missing[0]}")
    draft.generation_config = target.generation_config
    return draft


def calibration_sequences(data, count: int = 16, length: int = 256) -> List[torch.Tensor]:
    """The first `count` training sequences (at most `length` tokens each): what a narrowed draft's basis is measured
    on (train/narrow.py); none without training data."""
    if data is None:
        return []
    return [data.sequences[i][:length] for i in data.train[:count]]


class DraftModelDrafter:
    teacher_ids = None  # the loss compares full-vocabulary distributions

    def __init__(self, cfg: DictConfig, target: nn.Module, data=None, tokenizer=None):
        dr = cfg.drafter
        if dr.path:
            path = resolve_target(dr.path)  # a built-in model's name (qwen2.5-coder-0.5b-instruct) → its folder
            if Path(path).expanduser().is_dir():  # a local folder: damaged weights are one line naming the file
                check_model_folder(Path(path).expanduser(), "draft model")
            try:
                module = AutoModelForCausalLM.from_pretrained(path, dtype=MASTER_DTYPE)
            except (OSError, ValueError) as e:
                raise SpecdrafterError(f"could not load draft model {dr.path!r}: {str(e).splitlines()[0]}") from None
            try:
                draft_tokenizer = AutoTokenizer.from_pretrained(path)
            except (OSError, ValueError, TypeError):
                draft_tokenizer = None  # a weights-only folder: only the vocabulary size can be compared
            if tokenizer is not None and draft_tokenizer is not None and draft_tokenizer.get_vocab() != tokenizer.get_vocab():
                raise SpecdrafterError(f"draft model {dr.path!r} has another tokenizer than the target: token ids would "
                                       "not mean the same text")
            if dr.layers:  # cut to those of its layers (a smaller model of the target's family, e.g. its first two)
                have = module.config.num_hidden_layers
                if any(j >= have for j in dr.layers):
                    raise SpecdrafterError(f"recipe key 'drafter.layers': {dr.path!r} has layers 0..{have - 1}, got "
                                           f"{max(dr.layers)}")
                module = draft_model_from_target(module, list(dr.layers))
        else:  # layers within the target's (kinds/draft.py: planner_checks)
            module = draft_model_from_target(target, list(dr.layers) or list(range(dr.num_layers)))
        if dr.hidden_size:  # narrowed, calibrated on the first training sequences
            module = narrowed(module, dr.hidden_size, calibration_sequences(data))
        self.lora = None
        if dr.lora.r > 0:
            self.lora = LoraConfig(r=dr.lora.r, lora_alpha=dr.lora.alpha, lora_dropout=dr.lora.dropout,
                                   target_modules=list(dr.lora.target_modules), task_type="CAUSAL_LM")
            module = get_peft_model(module, self.lora)
        self.module, self.config = module, module.config
        self.prediction_names = ["draft"]

    def predictions(self, module, batch: Batch, target: TargetOutput) -> List[Prediction]:
        out = module(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True,
                     logits_to_keep=1)  # the full-vocabulary logits only where they count, below
        rows = counted_rows(batch.loss_mask, 1)
        logits = module.get_output_embeddings()(out.hidden_states[-1][rows])  # [N, V]
        return [Prediction("draft", 1.0, logits, target_rows(target, rows, 1))]

    def save(self, module, folder: Path, tokenizer) -> None:
        tmp = temp_dir_beside(folder)
        write_causal_lm(module, self.config, self.lora, tmp, tokenizer)
        publish_dir(tmp, folder)


def write_causal_lm(module, config, lora: Optional[LoraConfig], folder: Path, tokenizer) -> None:
    """A plain HF causal-LM folder (weights + tokenizer) from a trained module; a LoRA adapter is merged into a
    fresh copy, so the training module stays as it is."""
    fresh = AutoModelForCausalLM.from_config(config)
    if lora is not None:
        fresh = get_peft_model(fresh, lora)
        fresh.load_state_dict(module.state_dict())
        fresh = fresh.merge_and_unload()
    else:
        fresh.load_state_dict(module.state_dict())
    fresh.generation_config = module.generation_config
    fresh.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


# ---------------------------------------------------------------------------------------------- Medusa
class MedusaTwo(nn.Module):
    """Medusa-2's trained module: the heads and a LoRA-adapted copy of the target (the backbone to serve)."""

    def __init__(self, heads: MedusaHeads, backbone: nn.Module):
        super().__init__()
        self.heads, self.backbone = heads, backbone


class MedusaDrafter:
    """Medusa-1: heads on the frozen target's normed last hidden state. Medusa-2 (drafter.medusa.stage=2): the
    heads read a LoRA-adapted copy of the target, trained jointly; its own next-token distribution is distilled
    towards the original target's (the "backbone" prediction, weight 1) while the heads carry heads_weight.
    Saved as the heads folder with the merged backbone in `backbone/`, which decoding then serves as the target."""
    teacher_ids = None  # the loss compares full-vocabulary distributions

    def __init__(self, cfg: DictConfig, target: nn.Module, data=None, tokenizer=None):
        m, lora = cfg.drafter.medusa, cfg.drafter.lora
        heads = init_from_target(MedusaHeads(medusa_config(target.config, m.num_heads, m.num_layers)), target)
        self.module = heads.to(MASTER_DTYPE)
        self.norm = target.model.norm  # Medusa-1 heads read the frozen target's normed last hidden state
        self.last_layer = target.config.num_hidden_layers
        self.decay, self.heads_weight, self.lora = m.decay, 1.0, None
        self.prediction_names = [f"head{h + 1}" for h in range(m.num_heads)]
        if m.stage == 2:  # with drafter.lora.r > 0 (kinds/medusa.py: check_recipe)
            self.lora = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                   target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
            backbone = draft_model_from_target(target, range(self.last_layer))  # a trainable copy; the target stays frozen
            self.module = MedusaTwo(heads, get_peft_model(backbone, self.lora))
            self.backbone_config, self.heads_weight = backbone.config, m.heads_weight
            self.lr_scales = {"backbone.": m.backbone_lr_ratio}  # Medusa-2: the backbone moves slower than the heads
            self.prediction_names = ["backbone"] + self.prediction_names

    def predictions(self, module, batch: Batch, target: TargetOutput) -> List[Prediction]:
        out, heads = [], module
        if isinstance(module, MedusaTwo):
            heads = module.heads
            run = module.backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                  output_hidden_states=True, logits_to_keep=1)
            hidden = run.hidden_states[-1]  # [B, T, d] the adapted backbone's normed last hidden state
            rows = counted_rows(batch.loss_mask, 1)
            logits = module.backbone.get_output_embeddings()(hidden[rows])
            out.append(Prediction("backbone", 1.0, logits, target_rows(target, rows, 1)))
        else:
            hidden = self.norm(target.features[self.last_layer])  # [B, T, d]
        for h in range(heads.num_heads):  # head h predicts x_{t+h+2}
            rows = counted_rows(batch.loss_mask, h + 2)
            logits = heads.lm_heads[h](heads.blocks[h](hidden[rows]))  # [N, V] this head only
            out.append(Prediction(f"head{h + 1}", self.heads_weight * self.decay ** h, logits,
                                  target_rows(target, rows, h + 2)))
        return out

    def save(self, module, folder: Path, tokenizer) -> None:
        if not isinstance(module, MedusaTwo):
            save_medusa(module, folder)
            return
        tmp = temp_dir_beside(folder)
        write_config_and_weights(module.heads, tmp)
        write_causal_lm(module.backbone, self.backbone_config, self.lora, tmp / "backbone", tokenizer)
        publish_dir(tmp, folder)


# ----------------------------------------------------------------------------------------------- EAGLE-3
def start_draft_vocab(head: nn.Module, target: nn.Module, vocab: int, data=None) -> None:
    """An EAGLE-3-style head's draft vocabulary (the `vocab` tokens the data uses most, or the first `vocab` ids with
    no data to count: a shape check) and its lm_head started from the target's rows for the same tokens."""
    V = target.config.vocab_size
    if vocab < V and data is not None:
        d2t, t2d = build_draft_vocab(data.target_tokens(), V, vocab)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    else:
        head.t2d[:vocab] = True
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight[head.draft_ids])


class Eagle3Drafter:

    def __init__(self, cfg: DictConfig, target: nn.Module, data=None, tokenizer=None):
        e = cfg.drafter.eagle
        L, V = target.config.num_hidden_layers, target.config.vocab_size
        aux = list(e.aux_layer_ids) or default_aux_layers(L)  # checked against the target: kinds/eagle.py: planner_checks
        vocab = e.draft_vocab_size or V
        flags = {key: e[key] for key in EAGLE31_FLAGS}  # EAGLE-3.1's norms, when the recipe sets them
        head = Eagle3Head(eagle3_config(target.config, aux, vocab, e.attention_bias, flags)).to(MASTER_DTYPE)
        start_draft_vocab(head, target, vocab, data)
        self.module, self.embed = head, target.get_input_embeddings()
        self.teacher_ids = head.draft_ids if vocab < V else None  # the teacher's rows the loss needs (run_target)
        self.steps, self.decay = e.ttt_steps, e.step_decay
        self.prediction_names = [f"step{j}" for j in range(self.steps)]

    def predictions(self, module, batch: Batch, target: TargetOutput) -> List[Prediction]:
        fused = module.fuse(target.features)  # [B, T, d]
        hidden = training_time_test(module, self.embed, fused, batch.input_ids, self.steps)  # per step [B, T, d]
        out = []
        for j, h in enumerate(hidden):  # step j predicts x_{t+j+2}
            rows = counted_rows(batch.loss_mask, j + 2)
            index = target.rows(rows, j + 2)  # [N]
            if target.lse is None:  # full-vocabulary teacher rows
                p = target.logits[index]  # [N, V]
                in_vocab, lse = module.t2d[p.argmax(-1)], None  # [N] the draft can emit the target's top token: trained on
            else:  # draft-vocabulary teacher rows (teacher_ids)
                p, in_vocab, lse = target.logits[index], target.top_in_vocab[index], target.lse[index]
            out.append(Prediction(f"step{j}", self.decay ** j, module.logits(h[rows]), p, module.draft_ids,
                                  loss_rows=in_vocab, target_lse=lse))
        return out

    def save(self, module, folder: Path, tokenizer) -> None:
        save_eagle3(module, folder)


class Eagle1Drafter:
    """EAGLE-1: predicts the next last-layer feature; loss = feature_weight · SmoothL1(f̂_{t+1}, f_{t+1}) +
    ce_weight · objective(p_{t+1}, q) with q from the target's norm + lm_head on f̂."""
    teacher_ids = None  # the loss compares full-vocabulary distributions

    def __init__(self, cfg: DictConfig, target: nn.Module, data=None, tokenizer=None):
        e = cfg.drafter.eagle
        self.module = Eagle1Head(eagle1_config(target.config)).to(MASTER_DTYPE).attach(target)
        self.embed, self.L = target.get_input_embeddings(), target.config.num_hidden_layers
        self.feature_weight, self.ce_weight = e.feature_weight, e.ce_weight
        self.prediction_names = ["step0"]

    def predictions(self, module, batch: Batch, target: TargetOutput) -> List[Prediction]:
        f = target.features[self.L]  # [B, T, d]
        B, T = batch.input_ids.shape
        positions = torch.arange(T, device=f.device)[None].expand(B, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=f.device).tril()[None, None]
        embeds = self.embed(shift_left(batch.input_ids, 1)).to(f.dtype)  # [B, T, d] the target's, in the head's dtype
        predicted, _ = module(f, embeds, positions, causal)  # [B, T, d] f̂_{t+1}
        rows = counted_rows(batch.loss_mask, 2)
        b, t = rows
        feature = self.feature_weight * feature_loss(predicted[rows], f[b, t + 1], torch.ones_like(b, dtype=torch.bool))
        return [Prediction("step0", self.ce_weight, module.logits(predicted[rows]), target_rows(target, rows, 2),
                           feature_loss=feature)]

    def save(self, module, folder: Path, tokenizer) -> None:
        save_eagle3(module, folder)
