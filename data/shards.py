"""The data job's files: shards (a `datasets` folder each, published whole by a rename, with the shard.json that
records its prompts, its rows, the settings that made it and its files' checksums) and their hidden-state caches
(the target's features of every token, one safetensors file a shard). How a shard is written, checked before it
is reused (intact, same settings, same prompts), moved aside when damaged, and read back (`load_generated`).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import datasets
import torch
from omegaconf import DictConfig, OmegaConf
from safetensors import safe_open
from safetensors.torch import save_file

from specdrafter.core import llamacpp
from specdrafter.core.io import (
    SpecdrafterError,
    atomic_write_json,
    checksum_problem,
    file_checksums,
    first_line,
    json_file_problem,
    publish_dir,
    temp_dir_beside,
)
from specdrafter.core.recipe import Engine
from specdrafter.data.assets import resolve_target
from specdrafter.data.conversations import conversation_id
from specdrafter.data.gguf_assets import served_type
from specdrafter.models.features import capture_features

log = logging.getLogger("specdrafter")
datasets.disable_progress_bars()  # one progress bar (the data job's) is enough
SHARD_META = "shard.json"


# ---------------------------------------------------------------------------------------- hidden states
@torch.no_grad()
def target_hidden_states(model, sequences: List[List[int]], layer_ids: Sequence[int], batch_size: int,
                         dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """Hidden states of every token of every sequence, concatenated: {"layer_k": [N_tokens, d], "offsets": [n+1]}.

    Layer ids follow `data.features` (id k = input to layer k; id L = last layer's output, pre-norm).
    Sequences are right-padded, so padding never changes a real token's state.
    """
    per_layer: Dict[int, List[Optional[torch.Tensor]]] = {k: [None] * len(sequences) for k in layer_ids}
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))  # similar lengths together: little padding
    with capture_features(model, layer_ids) as hidden:
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            width = max(len(sequences[i]) for i in batch)
            input_ids = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
            attention_mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
            for row, i in enumerate(batch):
                input_ids[row, :len(sequences[i])] = torch.tensor(sequences[i])
                attention_mask[row, :len(sequences[i])] = 1
            model.model(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device))  # no logits
            for k in layer_ids:
                for row, i in enumerate(batch):
                    per_layer[k][i] = hidden[k][row, :len(sequences[i])].to(dtype).cpu()  # [T_i, d]
    lengths = torch.tensor([0] + [len(s) for s in sequences], dtype=torch.long)
    out = {f"layer_{k}": torch.cat(per_layer[k]).contiguous() for k in layer_ids}
    out["offsets"] = torch.cumsum(lengths, 0)
    return out


def hidden_states_bytes(num_tokens: int, num_layers: int, hidden_size: int, dtype: torch.dtype) -> int:
    return num_tokens * num_layers * hidden_size * torch.empty((), dtype=dtype).element_size()


def check_free_space(needed: int, folder: Path) -> None:
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise SpecdrafterError(f"the hidden-state cache may need {needed / 2**30:.1f} GiB but only {free / 2**30:.1f} GiB "
                               f"is free under {folder}; cache fewer layers or conversations")



# ----------------------------------------------------------------------------------------------- shards
def settings_fingerprint(cfg: DictConfig) -> dict:
    """The recipe values that determine a shard's contents (batch sizes and hidden-state options do not; nor does
    num_conversations: the selection is a prefix of one seeded order and each shard's prompt ids are checked, so
    a dataset grows or shrinks by whole shards without regenerating the others)."""
    d = OmegaConf.to_container(cfg.data, enum_to_str=True)
    for k in ("batch_size", "hidden_states", "num_conversations", "servers", "concurrency", "workers", "worker"):
        d.pop(k, None)
    engine_settings = d.pop("llamacpp")
    if cfg.data.engine is Engine.llamacpp:  # the GGUF's weight type decides the law it samples; its threads do not
        d["llamacpp.outtype"] = served_type(Path(resolve_target(cfg.target.model)), engine_settings["outtype"],
                                            llamacpp.GGUF_TYPE_OF[cfg.target.dtype.value])
    template = OmegaConf.to_container(cfg.target.chat_template_kwargs)  # absent when unset: older shards still match
    if d["loss_on_thinking"]:
        d.pop("loss_on_thinking")
    if d["rewritten_history"] == "split":  # the default: absent, so shards made before the key still match
        d.pop("rewritten_history")
    return {"target.model": cfg.target.model, "target.dtype": cfg.target.dtype.value,
            **({"target.chat_template_kwargs": template} if template else {}), **{f"data.{k}": v for k, v in d.items()}}


def shard_name(i: int) -> str:
    return f"shard-{i:05d}"


def hidden_path(out: Path, i: int) -> Path:
    """Shard i's hidden-state cache file."""
    return out / "hidden" / f"{shard_name(i)}.safetensors"


def claim_path(out: Path, name: str) -> Path:
    """The lock file a worker holds while it makes `name` (a shard, or a shard's hidden-state file)."""
    return out / ".claims" / name


def shard_problem(folder: Path, expected_ids: List[str], settings: dict) -> Optional[str]:
    """Why an existing shard cannot be reused as is (None if it is complete and intact).
    Raises if the shard is intact but was made with different settings: that is the user's call, not ours."""
    meta_path = folder / SHARD_META
    try:
        meta = json.loads(meta_path.read_text())
        problem = checksum_problem(folder, meta["files"])
        if problem:
            return problem
        n = datasets.load_from_disk(str(folder)).num_rows
    except FileNotFoundError as e:
        return f"{Path(e.filename).name if e.filename else 'a file'} is missing"
    except Exception as e:  # unreadable JSON / arrow: corrupt either way
        return f"unreadable ({type(e).__name__})"
    if meta["settings"] != settings:
        diff = next(k for k in settings if meta["settings"].get(k) != settings[k])
        raise SpecdrafterError(f"{folder} was generated with {diff}={meta['settings'].get(diff)!r}, the recipe now says "
                               f"{settings[diff]!r}; use a new output_dir or delete the old shards")
    if meta.get("prompt_ids", expected_ids) != expected_ids or not is_subsequence(meta["ids"], expected_ids) \
            or n != len(meta["ids"]):
        return "holds different prompts than this recipe selects"
    return None


def is_subsequence(kept: List[str], selected: List[str]) -> bool:
    """A shard keeps its prompts in order and drops the conversations that got no assistant turn (a conversation's
    later rows follow its first)."""
    conversations = [conversation_id(k) for k in kept]
    conversations = [c for i, c in enumerate(conversations) if i == 0 or c != conversations[i - 1]]
    rest = iter(selected)
    return all(any(k == s for s in rest) for k in conversations)


def move_aside(path: Path, output_dir: Path, reason: str) -> None:
    corrupt = output_dir / "corrupt"
    corrupt.mkdir(exist_ok=True)
    dest = corrupt / f"{path.name}.{time.strftime('%Y%m%d-%H%M%S')}"
    shutil.move(str(path), dest)
    log.warning(f"{path} is not usable ({reason}); moved aside to {dest}, regenerating it")


def write_shard(records: List[dict], prompt_ids: List[str], folder: Path, settings: dict) -> None:
    tmp = temp_dir_beside(folder)
    datasets.Dataset.from_list(records).save_to_disk(str(tmp))
    files = file_checksums(tmp)
    atomic_write_json(tmp / SHARD_META, {"num_rows": len(records), "ids": [r["id"] for r in records],
                                         "prompt_ids": prompt_ids, "settings": settings, "files": files})
    publish_dir(tmp, folder)


def hidden_file_ok(path: Path, layer_ids: Sequence[int], num_tokens: int) -> bool:
    try:
        with safe_open(str(path), "pt") as f:
            return set(f.keys()) >= {f"layer_{k}" for k in layer_ids} and int(f.get_tensor("offsets")[-1]) == num_tokens
    except Exception:
        return False


def write_hidden(tensors: Dict[str, torch.Tensor], path: Path, layer_ids: Sequence[int]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata={"layer_ids": json.dumps(list(layer_ids)),
                                           "convention": "layer_k = input to decoder layer k"})
    tmp.chmod(0o644)  # safetensors writes 0600; the cache is read like every other file (core/io.py)
    tmp.replace(path)



# ---------------------------------------------------------------------------------------------- reading
def load_generated(output_dir: str | Path, num_shards: Optional[int] = None) -> datasets.Dataset:
    """All shards of a data job as one Dataset (columns: id, messages, input_ids, loss_mask, ...)."""
    folders = sorted((Path(output_dir) / "shards").glob("shard-*"))
    if num_shards is not None:
        folders = folders[:num_shards]
    if not folders:
        raise SpecdrafterError(f"no generated shards under {output_dir}; run launch/generate_data.py first")
    return datasets.concatenate_datasets([load_shard(f) for f in folders])


def load_shard(folder: Path) -> datasets.Dataset:
    """One shard, checked against the checksums its shard.json recorded; a damaged shard is one line naming it."""
    meta = folder / SHARD_META
    problem = json_file_problem(meta) if meta.exists() else None  # shards always have one; tolerate hand-made ones
    if problem:
        problem = f"{SHARD_META} {problem}"
    elif meta.exists():
        files = json.loads(meta.read_text()).get("files")
        problem = checksum_problem(folder, files) if isinstance(files, dict) else f"{SHARD_META} lists no files"
    if problem is None:
        try:
            return datasets.load_from_disk(str(folder))
        except Exception as e:  # arrow / JSON errors of a folder that is not a saved dataset
            problem = f"unreadable ({first_line(e)})"
    raise SpecdrafterError(f"shard {str(folder)!r} is damaged: {problem}; rerun the data job (launch/generate_data.py) "
                           "to regenerate it")

