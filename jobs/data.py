"""The data job's command: `python -m specdrafter.jobs.data RECIPE.yaml [key=value ...] [--print-config]`
(launch/generate_data.py); the job itself is data/regenerate.py:generate_dataset.

With data.engine=llama.cpp the job serves the target itself: a target converted from a GGUF (the Qwen2.5-Coder
targets, data/gguf_assets.py) as the GGUF it came from, the file its users serve, unless data.llamacpp.outtype names
another type; any other converted once to GGUF (into the cache, at data.llamacpp.outtype, by default target.dtype's);
started as a llama-server with data.concurrency slots, each
holding one whole conversation, and stopped when the job ends, fails or is interrupted. It is started only when
some answer is still to be regenerated: a resumed job whose shards are all done, or a teacher-forced one, starts no
server. The regeneration then goes through the same client as data.engine=server (data/server.py: the probe, the
sampled ids, the template check).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List, Optional

from omegaconf import DictConfig
from transformers import AutoConfig

from specdrafter.core import llamacpp
from specdrafter.core.io import SpecdrafterError
from specdrafter.data.assets import resolve_target
from specdrafter.data.gguf_assets import served_gguf
from specdrafter.data.regenerate import generate_dataset
from specdrafter.inference.llama_server import LlamaServer
from specdrafter.jobs.cli import cli

log = logging.getLogger("specdrafter")
SLOT_MARGIN = 16  # tokens a slot keeps beyond its conversation (the template's closing tokens)


def run_data_job(cfg: DictConfig) -> dict:
    if cfg.data.engine.value != "llama.cpp":
        return generate_dataset(cfg)
    return generate_dataset(cfg, serve=lambda: served_target(cfg))


@contextmanager
def served_target(cfg: DictConfig) -> Iterator[List[str]]:
    """The target's llama-server while the data job regenerates (its GGUF converted first, once): yields its URL."""
    with target_server(cfg) as server:
        log.info(f"llama-server of the target on {server.url}: {server.threads} thread(s), {server.parallel} slot(s) "
                 f"of {server.context // server.parallel} tokens")
        yield [server.url]


def target_server(cfg: DictConfig) -> LlamaServer:
    """A llama-server of the recipe's target (not yet started): one slot per request in flight."""
    d = cfg.data
    if not llamacpp.installed():
        raise SpecdrafterError(f"data.engine=llama.cpp needs llama.cpp built: run {llamacpp.INSTALL_COMMAND}")
    folder = Path(resolve_target(cfg.target.model))
    if not folder.is_dir():
        raise SpecdrafterError(f"data.engine=llama.cpp converts the target's HF folder, and {cfg.target.model!r} is "
                               "not on this machine (use a local folder, or data.engine=server)")
    # a target converted from a GGUF answers as that very file, as its users serve it; any other at the recipe's type
    gguf = served_gguf(folder, d.llamacpp.outtype.value if d.llamacpp.outtype is not None else None,
                       default=llamacpp.GGUF_TYPE_OF[cfg.target.dtype.value])
    return LlamaServer(gguf, threads=d.llamacpp.threads or len(os.sched_getaffinity(0)), parallel=d.concurrency,
                       context=d.concurrency * slot_tokens(cfg, folder), extra=["--jinja"])


def slot_tokens(cfg: DictConfig, folder: Path) -> int:
    """What one slot must hold: a conversation of data.max_turns turns of prompt and answer, at most the target's
    context window (a reply that reaches the slot's end comes back unfinished, and is counted as such)."""
    d = cfg.data
    window = getattr(AutoConfig.from_pretrained(folder), "max_position_embeddings", None) or 1 << 30
    return min(window, d.max_turns * (d.max_prompt_tokens + d.max_new_tokens) + SLOT_MARGIN)


def main(argv: Optional[List[str]] = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cli(run_data_job, argv)


if __name__ == "__main__":
    main()
