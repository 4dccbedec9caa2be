"""The plan as text (launch/plan.py prints it): the run, the terms per rank, the data, the numbers per node, and the
checks."""

from __future__ import annotations

from typing import List

from omegaconf import DictConfig

from specdrafter.kinds import KINDS, kind_of
from specdrafter.train.memory import GIB, Plan, dtype_bytes, precision


def _gib(n: float) -> str:
    return f"{n / GIB:8.2f}"


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1e3:.1f} kB"


def format_plan(p: Plan, cfg: DictConfig) -> str:
    t, s = cfg.train, p.setup
    bf16, amp = precision(cfg, s.device)
    lines = [f"plan: {p.recipe} — {p.kind} on {cfg.target.model} ({cfg.target.dtype.value}), ZeRO {t.zero_stage}, "
             f"precision {t.precision.value} ({'bf16' if bf16 else 'fp32'} weights{', bf16 autocast' if amp else ''}), "
             f"{s.nodes} node(s) × {s.gpus_per_node} GPU(s) = world {s.world}" if KINDS[p.kind].training else
             f"plan: {p.recipe} — target {cfg.target.model}; drafter.kind={p.kind} trains nothing: data and disk only"]
    if p.counts:
        c = p.counts
        active = f", {c.target_active / 1e9:.3f} B active per token" if c.target_active else ""
        lines.append(f"target {c.target / 1e9:.3f} B parameters{active} (frozen); drafter {c.trainable / 1e6:.1f} M trainable"
                     + (f", {c.frozen / 1e6:.1f} M frozen" if c.frozen else ""))
        lines.append(f"{'per rank':<52}{'GiB':>8}")
        for name, size in p.terms.items():
            lines.append(f"  {_label(name, cfg):<50}{_gib(size)}")
        lines.append(f"  {'total':<50}{_gib(p.total)}  of {p.budget_gb:g} ({p.budget_source})")
        lines += [f"  note: {n}" for n in p.notes]
    if p.serving_cache:
        cache = ", ".join(f"{_gib(b).strip()} GiB at {c:,}" for c, b in p.serving_cache.items())
        lines.append(f"serving: the target's KV cache per sequence (bf16; sliding windows capped, MLA compressed, "
                     f"linear-attention state fixed): {cache} tokens of context")
    lines += _data_lines(p, cfg)
    lines += _node_lines(p, cfg)
    lines.append("checks")
    lines += [f"  {'ok  ' if ok else 'FAIL'} {line}" for ok, line in p.checks]
    return "\n".join(lines)


def _label(name: str, cfg: DictConfig) -> str:
    t = cfg.train
    if name == "activations":
        return f"activations ({t.micro_batch_size} × {t.max_length} tokens{kind_of(cfg).planning.activation_label(cfg)})"
    return name


def _data_lines(p: Plan, cfg: DictConfig) -> List[str]:
    f = p.data
    how = "measured (stats.json)" if f["measured"] else f"at most: {f['conversations']} conversations × ≤ {f['per_conversation']}"
    cache = "cached by the data job" if f["cached"] else "not cached (online features); offline it would take"
    return ["data",
            f"  data job: {f['job']}",
            f"  tokens: {f['tokens']:,} ({how}); training reads ≤ {f['train_tokens']:,} "
            f"(train.max_length {cfg.train.max_length})",
            f"  hidden-state cache, layers {f['cache_layers']}: {cache} {_size(f['cache_per_million'])} per 1M tokens, "
            f"{_size(f['cache_total'])} for this data"]


def _node_lines(p: Plan, cfg: DictConfig) -> List[str]:
    s, f = p.setup, p.data
    lines = [f"per node ({s.gpus_per_node} GPU(s), {s.nodes} node(s))"]
    if p.counts:
        bt = dtype_bytes(cfg.target.dtype.value)
        host = s.gpus_per_node * (p.counts.target * bt + 16 * int(f["train_tokens"]))
        mapped = "; the cache is memory-mapped, read from disk and shared by the node's ranks" \
            if cfg.train.features.value == "offline" else ""
        lines.append(f"  GPU memory {s.gpus_per_node} × {p.total / GIB:.1f} GiB; host RAM ≥ {host / GIB:.1f} GiB (each rank "
                     f"loads the target on the host and holds every conversation{mapped})")
    disk = 20 * int(f["tokens"]) + (int(f["cache_total"]) if cfg.train.features.value == "offline" else 0)
    lines.append(f"  disk: train.data_dir ≈ {_size(disk)} on every node (shards"
                 f"{' + hidden/' if cfg.train.features.value == 'offline' else ''}); output_dir on a filesystem all nodes share")
    if p.counts:
        ckpt = 16 * p.counts.trainable + 4 * p.counts.frozen
        lines.append(f"  checkpoints ≈ {_size(ckpt)} each × train.keep_checkpoints {cfg.train.keep_checkpoints} "
                     "(every rank writes its ZeRO partition)")
    return lines
