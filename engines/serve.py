"""Serve a trained drafter in llama.cpp, with the block length that pays here, or say plainly that none does.

    specdrafter-serve DRAFTER [--target-gguf T.gguf] [--k N] [--port 8080] [--threads 1] [--plan-only]
    python launch/serve_llamacpp.py DRAFTER ...                                                   (the same)

DRAFTER is a training checkpoint or run (exported to GGUF first, beside it, once), an export folder holding
`draft.gguf` (`launch/export.py --format gguf`), an export in the layout llama.cpp's converter reads for its kind
(`--format vllm` for EAGLE-3, DFlash and DSpark, `hf-draft` for a draft model: converted once, into the cache; an
export in another format is refused, naming what to pass instead), or a drafter GGUF. The target is the one the
drafter's recipe names (converted to GGUF once, into the cache) unless --target-gguf gives one.

Before serving, the drafter is measured in llama.cpp on this machine (eval/llamacpp.py: v(n) with llama-bench, then
the drafter at n_max = 1, 2, 3, 4 and at the largest block on MT-Bench prompts at T = 0) and the cost model picks k. The
measurement is cached under <cache>/llama.cpp/plans/, keyed by the two GGUF files and the thread count: a rerun
serves at once. The plan also measures llama.cpp's confidence cut (--spec-draft-p-min: a step stops drafting where
the drafter's top probability falls below it) at the largest block, and serves a cut where it beats the best plain k.
When no k is predicted to pay (speedup < 1 + the timing noise), the target is served without the
drafter and the reason printed; --k N serves the drafter anyway. llama-server runs in the foreground until Ctrl-C,
and no server outlives the command (a failed start, Ctrl-C, SIGTERM, SIGHUP, and SIGKILL through the kernel's
parent-death signal: inference/llama_server.py).

Bad input, one line each: a drafter kind llama.cpp cannot serve, a target GGUF of another model (its vocabulary or
width differs from what the drafter was trained on), --k outside 1 to the drafter's block, a port in use.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import List, Optional, Tuple

from omegaconf import OmegaConf
from transformers import AutoTokenizer

from specdrafter.core import llamacpp
from specdrafter.core.cache import cache_dir
from specdrafter.core.io import SpecdrafterError, atomic_write_json, publish_dir, temp_dir_beside
from specdrafter.data.assets import load_prompt_set
from specdrafter.data.chat import user_prompt_ids
from specdrafter.data.gguf_assets import served_gguf
from specdrafter.eval.llamacpp import CONFIDENCE_CUTS, POOLS_SLEEP, Calibration, Choice, calibrate
from specdrafter.export.formats import export
from specdrafter.export.gguf import DRAFT_FILE, GGUF_TYPES, OUTTYPE, read_gguf, write_gguf
from specdrafter.export.source import Source, find_source, target_of
from specdrafter.inference.llama_server import LlamaServer, port_in_use
from specdrafter.kinds import KINDS, Kind, kind_of_gguf
from specdrafter.kinds.base import LlamaCpp

PLAN_PROMPTS, PLAN_TOKENS = 6, 64  # MT-Bench prompts × tokens each, per calibration arm
PLAN_VERSION = 3  # part of a cached plan's key: a plan measured another way is measured again (2: c at k = 1..4 and K;
# 3: the best k with the idle thread pool asleep)


@dataclass
class Drafter:
    """A drafter GGUF and what serving it needs."""

    gguf: Path
    kind: Kind  # the kind its GGUF holds (kinds.kind_of_gguf), whose export.llamacpp record says how it is served
    facts: dict  # read_gguf's
    target_folder: Optional[Path]  # the target's HF folder, where the recipe names one this machine has

    @property
    def engine(self) -> LlamaCpp:
        return self.kind.export.llamacpp

    @property
    def spec_type(self) -> str:
        """llama-server's --spec-type for it."""
        return self.engine.spec_type

    @property
    def max_k(self) -> int:
        """The most draft tokens one step can take (a block drafter: its block)."""
        return self.engine.longest_block(self.facts)


def drafter_kind(gguf: Path, facts: dict) -> Kind:
    """The kind a drafter GGUF holds, or one line naming its architecture when no kind llama.cpp serves declares it."""
    kind = kind_of_gguf(facts)
    if kind is None:
        raise SpecdrafterError(f"{str(gguf)!r} is a GGUF of architecture {facts['arch']!r}, which no drafter kind "
                               "llama.cpp serves declares (an EAGLE-3 head, a DFlash or DSpark drafter, or a draft model "
                               "with the target's vocabulary)")
    return kind


def resolve_drafter(path: Path, target_dir: Optional[Path] = None, outtype: str = OUTTYPE) -> Drafter:
    """DRAFTER as a GGUF with its facts (a checkpoint, or an export llama.cpp's converter reads, is converted first,
    once, at weight type `outtype`). `target_dir`: the target's HF folder, where the drafter's recipe names none on
    this machine."""
    folder = None
    if path.is_dir() and not (path / DRAFT_FILE).is_file():
        fmt = export_format(path)
        path, folder = export_checkpoint(path, outtype) if fmt is None else convert_export(path, fmt, target_dir,
                                                                                             outtype)
    gguf = path / DRAFT_FILE if path.is_dir() else path
    if not gguf.is_file():
        raise SpecdrafterError(f"{str(path)!r} is not a drafter GGUF, an export folder with {DRAFT_FILE}, "
                               "or a checkpoint")
    facts = read_gguf(gguf)
    kind = drafter_kind(gguf, facts)
    recipe = gguf.parent / "recipe.yaml"
    if folder is None and recipe.is_file():  # an export's recipe names its target by Hub id or folder name
        folder = target_of(OmegaConf.load(recipe)).folder
    return Drafter(gguf, kind, facts, folder)


def export_checkpoint(path: Path, outtype: str = OUTTYPE) -> Tuple[Path, Optional[Path]]:
    """The GGUF export of the newest checkpoint at `path` (weights of type `outtype`), written beside it once, and
    the target's folder."""
    src = find_source(path)
    beside = src.drafter.parent if src.drafter.name == "drafter" else src.drafter  # the checkpoint holding drafter/
    out = beside / ("gguf" if outtype == OUTTYPE else f"gguf-{outtype}")
    if not (out / DRAFT_FILE).is_file():
        print(f"exporting {path} to GGUF ({out})", flush=True)
        export(path, "gguf", out, gguf_type=outtype)
    return out, target_of(src.recipe).folder


def export_format(folder: Path) -> Optional[str]:
    """The --format of an export folder (its model card says "exported as `FORMAT`"), or None for any other folder."""
    card = folder / "README.md"
    found = re.search(r"exported as `([\w-]+)`", card.read_text(errors="replace")) if card.is_file() else None
    return found.group(1) if found else None


def convert_export(folder: Path, fmt: str, target_dir: Optional[Path],
                   outtype: str = OUTTYPE) -> Tuple[Path, Optional[Path]]:
    """An export folder converted to GGUF once, into the cache, when it is in the layout llama.cpp's converter reads
    for its kind (export/gguf.py: the kind's `converts`): the same conversion and checks as `--format gguf`, from the
    export's files as they are. Any other format is refused in one line naming the folder and what to pass instead.
    Returns the GGUF's folder and the target's."""
    src = find_source(folder)
    spec = src.kind.export.llamacpp if src.kind.export else None
    if spec is None:
        raise SpecdrafterError(f"{str(folder)!r} is a --format {fmt} export of {src.kind.description}, which llama.cpp "
                               "does not serve (it serves " + ", ".join(k.description for k in KINDS.values()
                                                                  if k.export and k.export.llamacpp) + ")")
    if fmt != spec.converts:
        raise SpecdrafterError(f"{str(folder)!r} is a --format {fmt} export of {src.kind.description}; llama.cpp's "
                               f"converter reads the --format {spec.converts} layout: pass the checkpoint it was "
                               f"exported from, or its --format {spec.converts} or --format gguf export")
    target = target_of(src.recipe)
    target_folder = target_dir or target.folder
    if target_folder is None:
        raise SpecdrafterError(f"{str(folder)!r} is converted to GGUF beside its target's config and tokenizer, and "
                               f"its target {target.name!r} is not on this machine: give its HF folder with --target-dir")
    files = sorted(folder.glob("*.json")) + sorted(folder.glob("*.safetensors"))
    key = llamacpp.files_key(files, "" if outtype == OUTTYPE else outtype)[:12]
    out = cache_dir() / "llama.cpp" / "drafters" / f"{folder.name}-{key}"
    if not (out / DRAFT_FILE).is_file():
        print(f"converting the --format {fmt} export {folder} to GGUF with llama.cpp's converter (cached: {out})",
              flush=True)
        tmp = temp_dir_beside(out)
        try:
            write_gguf(src, tmp, replace(target, folder=target_folder), copy_export, outtype)
            publish_dir(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out, target_folder


def copy_export(src: Source, stage: Path, target, fmt: str) -> None:
    """write_gguf's layout writer for an export already in that layout: its config and weights, as they are."""
    for f in [src.drafter / "config.json", *sorted(src.drafter.glob("*.safetensors"))]:
        shutil.copyfile(f, stage / f.name)


def has_confidence(drafter: Drafter) -> bool:
    """Whether llama.cpp can cut this drafter's drafts by confidence (--spec-draft-p-min): the kind's record says."""
    return drafter.engine.confidence_cut(drafter.facts)


def check_pair(drafter: Drafter, target: Path) -> dict:
    """The target GGUF is the model the drafter was trained for: the same vocabulary, and for a head or a block
    drafter the width of the features it reads. Returns the target's facts."""
    t, d = read_gguf(target), drafter.facts
    if d["vocab_size"] and t["vocab_size"] and d["vocab_size"] != t["vocab_size"]:
        raise SpecdrafterError(f"the target GGUF has a vocabulary of {t['vocab_size']} tokens and the drafter one of "
                               f"{d['vocab_size']}: not the target it was trained for")
    width = t["fields"].get(f"{t['arch']}.embedding_length")
    reads = d["fields"].get(f"{d['arch']}.target_hidden_size")
    if reads is not None and width is not None and int(reads) != int(width):
        raise SpecdrafterError(f"the target GGUF is {width} wide and the drafter reads features {reads} wide: not the "
                               "target it was trained for")
    return t


def gguf_pair(drafter_path: Path, target_folder: Path, outtype: Optional[str] = None,
              drafter_type: str = OUTTYPE) -> Tuple[Drafter, Path]:
    """A drafter (checkpoint, export or GGUF; one converted here at `drafter_type`) and its target's GGUF
    (data/gguf_assets.py:served_gguf: the file a GGUF target came from, else the folder converted at `outtype`, f32 by
    default), checked as a pair."""
    drafter = resolve_drafter(Path(drafter_path), target_folder, drafter_type)
    drafter.target_folder = target_folder
    target = served_gguf(target_folder, outtype)
    check_pair(drafter, target)
    return drafter, target


def plan_prompts(folder: Optional[Path]) -> List[List[int]]:
    """MT-Bench's first PLAN_PROMPTS prompts in the target's chat template (its tokenizer from its HF folder)."""
    if folder is None:
        raise SpecdrafterError("the drafter's recipe names no target folder on this machine, so no prompts can be laid "
                               "out to measure it: give the target with --target-dir")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return [user_prompt_ids(tokenizer, r["turns"][0]) for r in load_prompt_set("mtbench")[-PLAN_PROMPTS:]]


def plan_path(drafter: Drafter, target: Path, threads: int) -> Path:
    """Where the drafter's calibration is cached: keyed by the two files and the thread count."""
    key = llamacpp.files_key([target.resolve(), drafter.gguf.resolve()],
                             f"threads={threads}:{llamacpp.SDIST.version}:plan={PLAN_VERSION}")
    return cache_dir() / "llama.cpp" / "plans" / f"{key[:16]}.json"


def plan(drafter: Drafter, target: Path, threads: int, fresh: bool = False) -> Calibration:
    """The drafter's calibration on this machine, cached by the two files and the thread count."""
    cached = plan_path(drafter, target, threads)
    if cached.is_file() and not fresh:
        try:
            return Calibration.from_json(json.loads(cached.read_text()))
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache entry is measured again
    print(f"measuring {drafter.spec_type} in llama.cpp on this machine ({threads} thread(s); cached once done)",
          flush=True)
    found = calibrate(target, drafter.gguf, drafter.spec_type, drafter.max_k, plan_prompts(drafter.target_folder),
                      PLAN_TOKENS, threads, cuts=CONFIDENCE_CUTS if has_confidence(drafter) else ())
    atomic_write_json(cached, found.to_json())
    return found


def advice(cal: Calibration) -> List[str]:
    """The table of predicted speedups and the recommendation, as printed."""
    lines = ["k  tokens/step  c      v(k+1)  predicted"]
    lines += [f"{r['k']:<2} {r['tokens_per_step']:<12} {r['c']:<6} {r['v']:<7} {r['predicted_speedup']}×"
              for r in cal.table()]
    for k, cost in cal.sleeping.items():
        lines += ["", f"at k = {k} with the idle thread pool asleep ({' '.join(POOLS_SLEEP)}): a step costs {cost:.3f} "
                      f"target steps (plain: {cal.step_cost(k):.3f}), predicted {cal.tokens_per_step(k) / cost:.3f}×"]
    if cal.cuts:
        lines += ["", f"with a confidence cut at k = {cal.max_k}: p_min  drafts/step  tokens/step  step cost  predicted"]
        lines += [f"{'':<39}{c.p_min:<6g} {c.drafts_per_step:<12.2f} {c.tokens_per_step:<12.3f} {c.step_cost:<10.3f} "
                  f"{c.predicted:.3f}×" for c in cal.cuts]
    return lines


def setting(k: int, p_min: float, pools_sleep: bool = False) -> str:
    """A drafter's setting as the messages name it: k, the confidence cut if any, and llama-server's flags."""
    flags = Choice(k, 0.0, False, 0.0, p_min, pools_sleep).flags()
    return f"k = {k}" + (f" with p_min {p_min:g}" if p_min else "") + (" with idle pools asleep" if pools_sleep else "") \
        + f" ({flags})"


def serve(server: LlamaServer) -> None:
    """Run until Ctrl-C, SIGTERM or SIGHUP; the server is stopped either way (and by the kernel on SIGKILL)."""
    with server:
        print(f"llama-server is serving on {server.url} (Ctrl-C stops it)", flush=True)
        while server.alive():
            time.sleep(0.5)
        raise SpecdrafterError(f"llama-server exited: {server.last_log_line()}")


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="specdrafter-serve", description=__doc__.split("\n")[0])
    p.add_argument("drafter", type=Path, help="a checkpoint or run, an export folder with draft.gguf, or a GGUF")
    p.add_argument("--target-gguf", type=Path, help="the target as GGUF (default: the recipe's target, converted)")
    p.add_argument("--target-dir", type=Path, help="the target's HF folder, when the recipe's is not on this machine")
    p.add_argument("--k", type=int, help="serve the drafter at this --spec-draft-n-max, whatever the plan says")
    p.add_argument("--p-min", type=float, default=0.0, help="with --k: llama.cpp's confidence cut "
                   "(--spec-draft-p-min; 0 drafts k tokens every step)")
    p.add_argument("--port", type=int, default=8080, help="the port llama-server listens on (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="llama.cpp's threads (1 on a shared machine)")
    p.add_argument("--drafter-type", default=OUTTYPE, choices=GGUF_TYPES,
                   help="a checkpoint or export is converted to GGUF at this weight type (default %(default)s, as "
                        "trained; q8_0: as draft models are served)")
    p.add_argument("--replan", action="store_true", help="measure again instead of using the cached plan")
    p.add_argument("--plan-only", action="store_true", help="print the plan and the advice, serve nothing")
    a = p.parse_args(argv)
    try:
        run(a)
    except SpecdrafterError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
        sys.exit(130)


def run(a) -> Optional[Calibration]:
    if not 0 <= a.p_min < 1 or (a.p_min and a.k is None):
        raise SpecdrafterError(f"--p-min {a.p_min:g}: a confidence cut in [0, 1), given with --k (without --k the "
                               "plan chooses both)")
    drafter = resolve_drafter(a.drafter, a.target_dir, a.drafter_type)
    if a.target_dir is not None:
        drafter.target_folder = a.target_dir
    if a.k is not None and not 1 <= a.k <= drafter.max_k:
        raise SpecdrafterError(f"--k {a.k}: k must be between 1 and {drafter.max_k} (this {drafter.spec_type} drafter "
                               f"drafts at most {drafter.max_k} tokens a step)")
    if a.p_min and not has_confidence(drafter):
        raise SpecdrafterError(f"--p-min {a.p_min:g}: this {drafter.kind.description} has no confidence head to cut by "
                               "(llama-server takes only --spec-draft-p-min 0 for it)")
    if a.target_gguf is None and drafter.target_folder is None:
        raise SpecdrafterError("the drafter's target is not on this machine: give it with --target-gguf (and "
                               "--target-dir for its tokenizer)")
    target = a.target_gguf or served_gguf(drafter.target_folder)
    check_pair(drafter, target)
    if not a.plan_only and port_in_use(a.port):  # before minutes of measuring
        raise SpecdrafterError(f"port {a.port} is in use (another server?): choose another with --port")
    k, p_min, asleep, cal = a.k, a.p_min, False, None
    verb, note = ("would be", " (--plan-only: nothing is served now)") if a.plan_only else ("is", "")
    if k is None:
        cal = plan(drafter, target, a.threads, a.replan)
        print("\n".join(advice(cal)))
        choice = cal.choose()
        if choice.pays:
            k, p_min, asleep = choice.k, choice.p_min, choice.pools_sleep
            print(f"the drafter {verb} served at {setting(k, p_min, asleep)}: predicted {choice.predicted:.2f}× over the "
                  f"target alone{note}", flush=True)
        else:
            needed = cal.alpha_needed(1 + choice.noise)
            would = (f"at these costs it would take an acceptance of {needed:.2f} per draft" if needed else
                     "no acceptance would make it pay at these costs")
            best = setting(choice.k, choice.p_min, choice.pools_sleep)
            print(f"no k pays here: the best, {best}, is predicted {choice.predicted:.2f}× "
                  f"(timing noise ±{choice.noise:.0%}), so the target {verb} served without the drafter{note}; {would} (this "
                  f"drafter: {cal.reach[0]:.2f} at the first). Train it longer, or pass --k N to serve it anyway.",
                  flush=True)
    else:
        print(f"the drafter {verb} served at {setting(k, p_min)}, as --k asks (no plan measured){note}", flush=True)
    if a.plan_only:
        return cal
    if k is None:
        serve(LlamaServer(target, threads=a.threads, port=a.port))
    else:
        serve(LlamaServer(target, drafter.gguf, drafter.spec_type, n_max=k, p_min=p_min, threads=a.threads,
                          port=a.port, extra=list(POOLS_SLEEP) if asleep else []))
    return cal


if __name__ == "__main__":
    main()
