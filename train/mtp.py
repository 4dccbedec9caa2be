"""A target's own multi-token-prediction layer (MTP / NextN: DeepSeek-V3, Qwen3-Next) as the drafter: read from the
target's folder (transformers drops these tensors when it loads the target), fine-tuned against the frozen target,
and written back under the target's own tensor names (docs/algorithms.md §MTP).

One step, at position t: x = eh_proj(concat(enorm(embedding of x_{t+1}), hnorm(h_t))) → the target's own decoder
block → norm → the target's lm_head, predicting x_{t+2}. h_t is the target's last hidden state *after* its final norm
(what vLLM, SGLang, llama.cpp and transformers hand the layer). A chain feeds each step's state back as the next h:
DeepSeek-V3 the block's output before the norm, Qwen3-Next after it (vLLM's deepseek_mtp.py and qwen3_next_mtp.py,
llama.cpp's graphs agree). Training runs `steps` chained steps with the attention of EAGLE-3's training-time test
(train/eagle.py: ttt_mask), as FastMTP fine-tunes one MTP layer over several recursive steps.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

import torch
from omegaconf import DictConfig
from safetensors import safe_open
from torch import nn
from transformers import DynamicCache

from specdrafter.core.io import SpecdrafterError, publish_dir, temp_dir_beside
from specdrafter.core.weights import read_safetensors, save_weights
from specdrafter.data.assets import resolve_target
from specdrafter.train.batches import Batch
from specdrafter.train.drafters import MASTER_DTYPE, Prediction, TargetOutput, counted_rows
from specdrafter.train.eagle import shift_left, ttt_mask

WEIGHTS = "mtp.safetensors"  # a drafter folder's MTP tensors, under the target's own names
LAYOUT_KEY = "mtp_layout"  # a drafter folder's config.json: the target's config plus this key (its model_type)
EXPERT = ("gate_proj", "up_proj", "down_proj")  # a checkpoint's per-expert tensors, which transformers fuses


@dataclass(frozen=True)
class MtpLayout:
    """Where an architecture keeps its MTP layer in a checkpoint, and which state its chain feeds back."""
    count_key: str  # config.json key for the number of MTP layers (absent: counted from the tensors)
    prefix: str  # "{L}" stands for num_hidden_layers
    block: str  # the decoder block's tensors, after the prefix
    names: Dict[str, str]  # our module → the checkpoint's: enorm, hnorm, eh_proj, norm
    feeds_normed: bool  # the chain feeds norm(block output) back (else the block output itself)
    kept: Tuple[str, ...] = ()  # tensors under the prefix that are not trained (copies of the target's own)

    def prefix_of(self, num_layers: int) -> str:
        return self.prefix.format(L=num_layers)


LAYOUTS = {
    "deepseek_v3": MtpLayout("num_nextn_predict_layers", "model.layers.{L}.", "",
                             {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "norm": "shared_head.norm"},
                             feeds_normed=False, kept=("embed_tokens.", "shared_head.head.")),
    "qwen3_next": MtpLayout("mtp_num_hidden_layers", "mtp.", "layers.0.",
                            {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc",
                             "norm": "norm"}, feeds_normed=True),
}


def layout_of(config) -> MtpLayout:
    """The MTP layout of a target's config (one line for an architecture whose MTP layers are not mapped)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in LAYOUTS:
        raise SpecdrafterError(f"drafter.kind=mtp: the MTP layers of {model_type} targets are not mapped (valid: "
                               f"{', '.join(LAYOUTS)})")
    return LAYOUTS[model_type]


# ------------------------------------------------------------------------------------------------ the layer
class MtpLayer(nn.Module):
    """One MTP layer around a decoder block of the target's own class; embeddings, RoPE and lm_head stay the
    target's (passed in, never trained)."""

    def __init__(self, config, block: nn.Module, norm_cls, feeds_normed: bool):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm, self.norm = norm_cls(d, eps=eps), norm_cls(d, eps=eps), norm_cls(d, eps=eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.block = block
        self.feeds_normed = feeds_normed
        self.cache_index = block.self_attn.layer_idx  # the cache slot its attention writes

    def forward(self, hidden, embeds, rope, positions, mask, cache) -> Tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, T, d] (h_t, or the previous step's fed-back state), embeds [B, T, d] (x_{t+1}); rope the
        target's (cos, sin) at `positions`, mask additive [B, 1, T, S] or None. Returns (the state the next step
        reads, the normed state the lm_head reads), both [B, T, d]."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], -1))  # [B, T, d] embedding first
        out = self.block(x, attention_mask=mask, position_ids=positions, cache=cache, position_embeddings=rope)
        normed = self.norm(out)
        return (normed if self.feeds_normed else out), normed


def build_mtp(target: nn.Module) -> MtpLayer:
    """An MTP layer of the target's shape, randomly initialised (load_mtp fills it)."""
    config, layout = target.config, layout_of(target.config)
    L = config.num_hidden_layers
    block_config = copy.deepcopy(config)
    if getattr(config, "layer_types", None):  # the MTP block attends fully, whatever the target's last layer does
        block_config.layer_types = list(config.layer_types) + ["full_attention"]
    with torch.device(target.device):  # the planner's meta target: a layer of shapes only
        block = type(target.model.layers[-1])(block_config, L)  # layer index L: the MoE block, as the checkpoint's
        return MtpLayer(config, block, type(target.model.norm), layout.feeds_normed)


def attention_mask(allowed: torch.Tensor, dtype) -> torch.Tensor:
    """A boolean mask (True = attend) as the additive one HF attention takes."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


# ---------------------------------------------------------------------------------------- checkpoint layout
def target_folder(name: str) -> Path:
    """The local folder of a recipe's target.model (a Hub id: its snapshot in the Hugging Face cache, which loading
    the target fetched)."""
    path = Path(resolve_target(name)).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download  # only for a Hub id
    try:
        return Path(snapshot_download(name, local_files_only=True))
    except Exception:
        raise SpecdrafterError(f"drafter.kind=mtp reads the MTP layers from the target's files, and {name!r} is not "
                               "on this machine (load the target once, or point target.model at its folder)") from None


def checkpoint_mtp(folder: Path, config) -> Dict[str, torch.Tensor]:
    """The MTP tensors of a target folder, under their checkpoint names (read from the safetensors: transformers
    drops them); one line when it has none, or more than one MTP layer."""
    layout = layout_of(config)
    prefix = layout.prefix_of(config.num_hidden_layers)
    tensors, names = {}, []
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names += list(f.keys())
            tensors.update({k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)})
    if not tensors:
        raise SpecdrafterError(f"target folder {str(folder)!r} has no MTP layers (no {prefix}* tensors in its "
                               "safetensors): drafter.kind=mtp fine-tunes a target's own MTP layers")
    second = layout.prefix_of(config.num_hidden_layers + 1) if "{L}" in layout.prefix else f"{prefix}layers.1."
    if any(k.startswith(second) for k in names):
        raise SpecdrafterError(f"target folder {str(folder)!r} has more than one MTP layer; drafter.kind=mtp "
                               "fine-tunes one (chained for longer drafts, as the engines do)")
    return tensors


def fuse_experts(block: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Per-expert tensors (mlp.experts.{e}.gate_proj.weight, …) → transformers' fused ones (mlp.experts.gate_up_proj
    [E, 2I, d]: gate rows then up rows; mlp.experts.down_proj [E, d, I])."""
    out = {k: v for k, v in block.items() if ".experts." not in k or not k.split(".experts.")[1][0].isdigit()}
    heads = sorted({k.split(".experts.")[0] for k in block if k not in out})
    for head in heads:
        count = 1 + max(int(k.split(".experts.")[1].split(".")[0]) for k in block if k.startswith(head + ".experts."))
        w = {p: [block[f"{head}.experts.{e}.{p}.weight"] for e in range(count)] for p in EXPERT}
        out[f"{head}.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(w["gate_proj"], w["up_proj"])])
        out[f"{head}.experts.down_proj"] = torch.stack(w["down_proj"])
    return out


def split_experts(block: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The inverse of `fuse_experts`: the checkpoint's per-expert tensors."""
    out = {}
    for k, v in block.items():
        if k.endswith(".experts.gate_up_proj"):
            head = k[:-len(".gate_up_proj")]
            for e, w in enumerate(v):
                gate, up = w.chunk(2)
                out[f"{head}.{e}.gate_proj.weight"], out[f"{head}.{e}.up_proj.weight"] = gate, up
        elif k.endswith(".experts.down_proj"):
            out.update({f"{k[:-len('.down_proj')]}.{e}.down_proj.weight": w for e, w in enumerate(v)})
        else:
            out[k] = v
    return out


def to_module(tensors: Dict[str, torch.Tensor], layout: MtpLayout, prefix: str) -> Dict[str, torch.Tensor]:
    """Checkpoint names → MtpLayer's state dict (the kept copies of the target's own tensors left out)."""
    theirs = {f"{prefix}{n}.": f"{ours}." for ours, n in layout.names.items()}
    own, block = {}, {}
    for k, v in tensors.items():
        part = next((p for p in theirs if k.startswith(p)), None)
        if part:
            own[theirs[part] + k[len(part):]] = v
        elif not k[len(prefix):].startswith(layout.kept):
            block[k[len(prefix) + len(layout.block):]] = v
    return {**own, **{f"block.{k}": v for k, v in fuse_experts(block).items()}}


def to_checkpoint(state: Dict[str, torch.Tensor], layout: MtpLayout, prefix: str) -> Dict[str, torch.Tensor]:
    """MtpLayer's state dict → the checkpoint's names (the inverse of `to_module`)."""
    block = split_experts({k[len("block."):]: v for k, v in state.items() if k.startswith("block.")})
    out = {f"{prefix}{layout.block}{k}": v for k, v in block.items()}
    for ours, theirs in layout.names.items():
        out.update({f"{prefix}{theirs}.{k[len(ours) + 1:]}": v for k, v in state.items() if k.startswith(ours + ".")})
    return out


def load_into(layer: MtpLayer, tensors: Dict[str, torch.Tensor], config) -> MtpLayer:
    """Fill `layer` from checkpoint-named MTP tensors; one line for a missing or misshapen one."""
    layout = layout_of(config)
    prefix = layout.prefix_of(config.num_hidden_layers)
    state, own = to_module(tensors, layout, prefix), layer.state_dict()
    missing = [k for k in own if k not in state]
    if missing:
        name = next(iter(to_checkpoint({missing[0]: own[missing[0]]}, layout, prefix)))
        raise SpecdrafterError(f"the MTP layer lacks {name} (its checkpoint holds {len(tensors)} MTP tensors)")
    bad = next((k for k in own if own[k].shape != state[k].shape), None)
    if bad:
        raise SpecdrafterError(f"the MTP tensor for {bad} is {list(state[bad].shape)}, the target's layer needs "
                               f"{list(own[bad].shape)}")
    layer.load_state_dict({k: state[k] for k in own})
    return layer


def load_mtp(folder, target: nn.Module, dtype=None) -> MtpLayer:
    """The MTP layer from a target folder or a drafter folder this kind saved (mtp.safetensors), in `dtype`
    (default: the target's)."""
    folder = Path(folder).expanduser()
    if (folder / WEIGHTS).is_file():
        tensors = read_safetensors(folder / WEIGHTS)
    else:
        tensors = checkpoint_mtp(folder, target.config)
    return load_into(build_mtp(target), tensors, target.config).to(dtype or target.dtype)


def save_mtp(layer: MtpLayer, folder: Path, source: Path, config) -> None:
    """A drafter folder: mtp.safetensors (the trained layer under the target's names, plus the target's copies it
    kept as they were) and config.json (the target's, marked with LAYOUT_KEY), published atomically."""
    layout = layout_of(config)
    prefix = layout.prefix_of(config.num_hidden_layers)
    state = {k: v.detach().contiguous().cpu() for k, v in layer.state_dict().items()}
    tensors = {**checkpoint_mtp(source, config), **to_checkpoint(state, layout, prefix)}
    tmp = temp_dir_beside(folder)
    raw = json.loads((Path(source) / "config.json").read_text())
    (tmp / "config.json").write_text(json.dumps({**raw, LAYOUT_KEY: config.model_type}, indent=2) + "\n")
    save_weights({k: v.contiguous() for k, v in tensors.items()}, tmp / WEIGHTS)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, tmp / name)
    publish_dir(tmp, folder)


def recognises(config: dict) -> bool:
    """A drafter folder this kind saved."""
    return config.get(LAYOUT_KEY) in LAYOUTS


# ---------------------------------------------------------------------------------------------- training
def chained_steps(layer: MtpLayer, target: nn.Module, hidden: torch.Tensor, input_ids: torch.Tensor,
                  steps: int) -> List[torch.Tensor]:
    """`steps` chained steps over whole sequences; step j at position t reads x_{t+j+1} and (j = 0) the target's
    normed h_t, later the step before's state at t, sits at rotary position t + j and sees step 0's keys causally
    plus its own earlier steps' key at t (ttt_mask). Returns each step's normed state [B, T, d] (its logits predict
    x_{t+j+2})."""
    B, T = input_ids.shape
    positions = torch.arange(T, device=input_ids.device)[None].expand(B, T)  # [B, T]
    embed, rope = target.get_input_embeddings(), target.model.rotary_emb
    cache, out = DynamicCache(), []
    for j in range(steps):
        embeds = embed(shift_left(input_ids, j + 1)).to(hidden.dtype)  # [B, T, d] x_{t+j+1}
        mask = attention_mask(ttt_mask(T, j, input_ids.device), hidden.dtype)  # [1, 1, T, (j+1)·T]
        hidden, normed = layer(hidden, embeds, rope(embeds, positions + j), positions + j, mask, cache)
        out.append(normed)
    return out


class MtpDrafter:
    """Fine-tunes the target's MTP layer (the target stays frozen): step j's logits at t against the target's row
    for x_{t+j+2}, weighted step_decay^j."""
    teacher_ids = None  # the loss compares full-vocabulary distributions

    def __init__(self, cfg: DictConfig, target: nn.Module, data=None, tokenizer=None):
        m = cfg.drafter.mtp
        self.model = cfg.target.model
        if target.device.type == "meta":  # the planner: shapes only, no files read
            self.module = build_mtp(target)
        else:
            self.module = load_mtp(target_folder(self.model), target, MASTER_DTYPE)
        self.target, self.config = target, target.config
        self.steps, self.decay = m.steps, m.step_decay
        self.prediction_names = [f"step{j}" for j in range(self.steps)]

    def predictions(self, module, batch: Batch, target: TargetOutput) -> List[Prediction]:
        h = self.target.model.norm(target.features[self.config.num_hidden_layers])  # [B, T, d] after the final norm
        dtype = next(module.parameters()).dtype  # fp32, or bf16 under DeepSpeed's bf16 mode
        states = chained_steps(module, self.target, h.to(dtype), batch.input_ids, self.steps)
        head = self.target.lm_head
        out = []
        for j, normed in enumerate(states):  # step j predicts x_{t+j+2}
            rows = counted_rows(batch.loss_mask, j + 2)
            logits = head(normed[rows].to(head.weight.dtype)).float()  # [N, V] the target's own head
            out.append(Prediction(f"step{j}", self.decay ** j, logits, target.logits[target.rows(rows, j + 2)]))
        return out

    def save(self, module, folder: Path, tokenizer) -> None:
        save_mtp(module, folder, target_folder(self.model), self.config)
