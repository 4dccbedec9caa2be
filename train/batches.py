"""Training data: the data job's conversations (input_ids + loss_mask), a held-out split, a deterministic
per-epoch order, padded batches, and — offline mode — the cached target hidden states of each conversation."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from specdrafter.core.io import SpecdrafterError, json_file_problem
from specdrafter.core.recipe import load_saved_recipe
from specdrafter.core.weights import mmap_safetensors
from specdrafter.data.conversations import conversation_id
from specdrafter.data.shards import load_generated


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] right-padded with 0
    loss_mask: torch.Tensor  # [B, T] 1 on target-generated tokens
    attention_mask: torch.Tensor  # [B, T] 1 on real tokens
    features: Optional[Dict[int, torch.Tensor]] = None  # offline: {layer id: [B, T, d]}

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device) -> "Batch":
        features = {k: v.to(device) for k, v in self.features.items()} if self.features is not None else None
        return Batch(self.input_ids.to(device), self.loss_mask.to(device), self.attention_mask.to(device), features)


class TrainingData:
    def __init__(self, data_dir: str | Path, tokenizer, target_name: str, max_length: int, heldout: int, seed: int,
                 feature_layers: Sequence[int] = (), data_tokens: int = 0):
        """data_tokens > 0: only the first conversations of the dataset, as many as it takes to reach that many
        target-generated (loss-masked) tokens — how a scaling run trains on a prefix of one large dataset."""
        data_dir = Path(data_dir).expanduser()
        stats = data_dir / "stats.json"  # the data job's last run says how many shards make the dataset
        num_shards = read_stats(stats)["shards"] if stats.is_file() else None
        dataset = load_generated(data_dir, num_shards)
        if data_tokens:
            have = sum(dataset["num_response_tokens"])
            if have < data_tokens:
                raise SpecdrafterError(f"recipe key 'train.data_tokens' ({data_tokens}) exceeds the {have} target tokens "
                                       f"in {str(data_dir)!r}; generate more data (data.num_conversations)")
            reached = next(i for i, n in enumerate(itertools.accumulate(dataset["num_response_tokens"]), 1) if n >= data_tokens)
            dataset = dataset.select(range(reached))
        for column in ("input_ids", "loss_mask"):
            if column not in dataset.column_names:
                raise SpecdrafterError(f"dataset {str(data_dir)!r} has no {column!r} column; regenerate it with "
                                       "launch/generate_data.py")
        check_same_tokenizer(data_dir, dataset, tokenizer, target_name)
        self.sequences = [torch.tensor(ids[:max_length]) for ids in dataset["input_ids"]]
        self.masks = [torch.tensor(m[:max_length]) for m in dataset["loss_mask"]]
        self.features = (load_features(data_dir, feature_layers, len(self.sequences), max_length, num_shards)
                         if feature_layers else None)
        # rows by conversation: a conversation's later rows (data.rewritten_history=split) go where its first goes,
        # so no held-out row shares a context with a trained one
        ids = dataset["id"] if "id" in dataset.column_names else [str(i) for i in range(len(self.sequences))]
        conversations: Dict[str, List[int]] = {}
        for row, row_id in enumerate(ids):
            conversations.setdefault(conversation_id(row_id), []).append(row)
        groups = list(conversations.values())
        if len(groups) <= heldout:
            raise SpecdrafterError(f"recipe key 'train.heldout' ({heldout}) leaves no training conversations out of "
                                   f"{len(groups)} in {str(data_dir)!r}")
        order = torch.randperm(len(groups), generator=torch.Generator().manual_seed(seed)).tolist()
        self.heldout = sorted(row for g in order[:heldout] for row in groups[g])
        self.train = sorted(row for g in order[heldout:] for row in groups[g])
        self.seed = seed

    def epoch_order(self, epoch: int, group: int = 1) -> List[int]:
        """Training conversations in the order of `epoch`: a function of (seed, epoch) only, so a resumed run
        sees exactly the batches an uninterrupted one would. With group > 1 every run of `group` consecutive
        conversations (one step's micro-batches over all ranks) has similar lengths: the shuffled order is cut
        into windows of 64 groups, each window sorted by length, and the groups shuffled again — batches pad
        little while every epoch still mixes the data."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = [self.train[i] for i in torch.randperm(len(self.train), generator=g).tolist()]
        if group <= 1:
            return order
        window = 64 * group
        order = [i for w in range(0, len(order), window)
                 for i in sorted(order[w:w + window], key=lambda i: len(self.sequences[i]))]
        groups = [order[i:i + group] for i in range(0, len(order), group)]
        return [i for k in torch.randperm(len(groups), generator=g).tolist() for i in groups[k]]

    def target_tokens(self) -> List[torch.Tensor]:
        """The target-generated (loss-masked) tokens of the training split, for the EAGLE draft vocabulary."""
        return [self.sequences[i][self.masks[i].bool()] for i in self.train]

    def batch(self, indices: Sequence[int]) -> Batch:
        width = max(len(self.sequences[i]) for i in indices)
        input_ids = torch.zeros(len(indices), width, dtype=torch.long)  # [B, T]
        loss_mask = torch.zeros(len(indices), width, dtype=torch.long)  # [B, T]
        attention_mask = torch.zeros(len(indices), width, dtype=torch.long)  # [B, T]
        for row, i in enumerate(indices):
            n = len(self.sequences[i])
            input_ids[row, :n], loss_mask[row, :n], attention_mask[row, :n] = self.sequences[i], self.masks[i], 1
        features = None
        if self.features is not None:
            features = {}
            for k, rows in self.features.items():
                f = rows[indices[0]].new_zeros(len(indices), width, rows[indices[0]].shape[-1])  # [B, T, d]
                for row, i in enumerate(indices):
                    f[row, :len(rows[i])] = rows[i]
                features[k] = f
        return Batch(input_ids, loss_mask, attention_mask, features)


def read_stats(path: Path) -> dict:
    """The data job's stats.json (it says how many shards make the dataset); a damaged one is one line."""
    problem = json_file_problem(path)
    stats = json.loads(path.read_text()) if problem is None else {}
    if problem is None and not isinstance(stats.get("shards"), int):
        problem = "has no 'shards' count"
    if problem:
        raise SpecdrafterError(f"{str(path)!r} {problem}; rerun the data job (launch/generate_data.py) to rewrite it")
    return stats


def check_same_tokenizer(data_dir: Path, dataset, tokenizer, target_name: str) -> None:
    """Refuse data made for another target: the data job's recipe names its target, and the first conversation's
    prompt must re-tokenise to the same ids with this target's chat template."""
    recipe = data_dir / "recipe.yaml"
    if recipe.is_file():
        made_for = load_saved_recipe(recipe).get("target", {}).get("model")
        if made_for and made_for != target_name:
            raise SpecdrafterError(f"dataset {str(data_dir)!r} was generated by target {made_for!r}, not {target_name!r}")
    first = dataset[0]
    # (a stored message has every field any message of the shard has: a gpt-oss answer's `thinking` is None elsewhere)
    user = [{k: v for k, v in m.items() if v is not None} for m in first["messages"] if m["role"] == "user"][:1]
    prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    if list(first["input_ids"][:len(prompt)]) != list(prompt):
        raise SpecdrafterError(f"dataset {str(data_dir)!r} was tokenised with another tokenizer than the target's "
                               "(its first prompt does not re-tokenise to the same ids)")
    if max(max(ids) for ids in dataset["input_ids"]) >= len(tokenizer):
        raise SpecdrafterError(f"dataset {str(data_dir)!r} holds token ids beyond the target's vocabulary of {len(tokenizer)}")


def load_features(data_dir: Path, layer_ids: Sequence[int], num_conversations: int, max_length: int,
                  num_shards: Optional[int] = None) -> Dict[int, List[torch.Tensor]]:
    """Per-conversation cached hidden states {layer id: [tensor [T_i, d], ...]} from hidden/shard-*.safetensors."""
    files = sorted((data_dir / "hidden").glob("shard-*.safetensors"))[:num_shards]
    out: Dict[int, List[torch.Tensor]] = {k: [] for k in layer_ids}
    for path in files:
        tensors = mmap_safetensors(path)  # views of a memory map: the cache may be larger than RAM
        missing = [k for k in layer_ids if f"layer_{k}" not in tensors]
        if missing:
            raise SpecdrafterError(f"{path} caches no hidden states of layer {missing[0]}; add it to the data recipe's "
                                   "data.hidden_states.layer_ids and rerun the data job, or set train.features=online")
        offsets = tensors["offsets"].tolist()
        for k in layer_ids:
            out[k].extend(tensors[f"layer_{k}"][a:b][:max_length] for a, b in zip(offsets, offsets[1:]))
        if len(out[layer_ids[0]]) >= num_conversations:  # a prefix of the dataset (train.data_tokens) needs no more
            out = {k: rows[:num_conversations] for k, rows in out.items()}
            break
    if not files or len(out[layer_ids[0]]) != num_conversations:
        raise SpecdrafterError(f"the hidden-state cache under {str(data_dir / 'hidden')!r} does not cover all "
                               f"{num_conversations} conversations; rerun the data job or set train.features=online")
    return out
