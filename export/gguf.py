"""--format gguf: a drafter llama.cpp's llama-server serves beside a GGUF of its target (docs/llamacpp.md).

The folder of the kind's `export.llamacpp.converts` format (EAGLE-3, DFlash, DSpark: the vllm layout; a draft model:
hf-draft) is written first, then llama.cpp's own convert_hf_to_gguf.py, from the pinned source tree that
engines/llamacpp_build.py builds, turns it into `draft.gguf`: the engine's code decides what it reads. The converter fills in
defaults without a word, so two checks stand around it:
- before: an EAGLE-3 folder must carry its aux ids at the top level (`eagle_aux_hidden_state_layer_ids`), the only key
  the converter reads; without it the head would be served on the default layers [2, L // 2, L − 3];
- after: the GGUF's `target_layers` (llama.cpp names layer inputs, as we do) must be the layers the drafter was
  trained on, and a pruned draft vocabulary must arrive whole (its d2t, as absolute target ids); each of the
  folder's norm flags the converter copies (CONVERTED_FLAGS: EAGLE-3.1's norm_before_fc) must read back as written.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, List

from specdrafter.core import llamacpp
from specdrafter.core.io import SpecdrafterError, temp_dir_beside

if TYPE_CHECKING:  # annotations only
    from specdrafter.export.source import Source, Target

DRAFT_FILE = "draft.gguf"
OUTTYPE = "f32"  # the default: the drafter's weights are trained in fp32; f32 keeps the exported logits ours
# the weight types a drafter GGUF may take (--gguf-type): q8_0 and the K-quants are what users serve a draft model
# as (the quantized ones made by llama-quantize); its draft is another distribution than the trained one, which exact
# verification accepts like any other
GGUF_TYPES = ("f32", "bf16", "f16", "q8_0", *llamacpp.QUANTIZED_TYPES)
# config.json keys the converter copies into `<arch>.<key>` (conversion/llama.py), which change the graph it builds
CONVERTED_FLAGS = ("norm_before_fc", "norm_before_residual")
# gguf-py from the same tree reads the file back: the architecture, its target layers, the tensors' names and shapes
READ_BACK = """
import json, sys
from gguf import GGUFReader, GGUFValueType
r = GGUFReader(sys.argv[1])
arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")
layers = r.fields.get(arch + ".target_layers")
scalars = {}
for name, f in r.fields.items():
    if name.startswith("tokenizer.") or len(f.types) != 1 or not f.data:
        continue
    part = f.parts[f.data[0]]
    scalars[name] = str(bytes(part), "utf-8") if f.types[0] == GGUFValueType.STRING else part.tolist()[0]
tokens = r.fields.get("tokenizer.ggml.tokens")
print(json.dumps({"arch": arch, "target_layers": [int(layers.parts[i][0]) for i in layers.data] if layers else None,
                  "tensors": {t.name: [int(n) for n in t.shape] for t in r.tensors}, "fields": scalars,
                  "vocab_size": len(tokens.data) if tokens else None}))
"""


def write_gguf(src: Source, folder: Path, target: Target, write_layout, outtype: str = OUTTYPE) -> None:
    """draft.gguf in `folder`: `write_layout(src, stage, target, fmt)` writes the kind's convertible folder, which
    llama.cpp's converter reads with the target's own folder beside it (its config and tokenizer). The kind's
    `export.llamacpp` record says what is checked before and after."""
    engine = src.kind.export.llamacpp
    if target.folder is None:
        raise SpecdrafterError(f"--format gguf reads the target's config.json and tokenizer, and {target.name!r} is not "
                               "on this machine (export on the machine that trained it, or fetch the target first)")
    llamacpp.converter()  # one line, before anything is written, if llama.cpp is not installed
    target_config = json.loads((Path(target.folder) / "config.json").read_text())
    engine.check_target((target_config.get("architectures") or ["?"])[0], src.kind.description)
    if not engine.pruned_vocab and pruned_vocabulary(src.drafter):
        raise SpecdrafterError(f"--format gguf: llama.cpp's converter keeps no pruned draft vocabulary for "
                               f"{src.kind.description} (it maps no d2t); train it with the full vocabulary "
                               "(drafter.block.draft_vocab_size=0)")
    stage = temp_dir_beside(folder / "hf")
    try:
        write_layout(src, stage, target, engine.converts)
        config = json.loads((stage / "config.json").read_text())
        engine.check_config(config)
        llamacpp.convert(stage, folder / DRAFT_FILE, target.folder, outtype)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    check_gguf(folder / DRAFT_FILE, engine.trained_layers(config), config)


def pruned_vocabulary(drafter: Path) -> bool:
    """The drafter folder's config.json names a draft vocabulary smaller than the target's."""
    config = json.loads((drafter / "config.json").read_text())
    return bool(config.get("draft_vocab_size")) and config["draft_vocab_size"] < config.get("vocab_size", 0)


def read_gguf(path: Path) -> dict:
    """{"arch", "target_layers", "tensors": {name: shape}, "fields": {key: scalar}, "vocab_size"} of a GGUF file,
    read by the gguf-py of the pinned tree (the tokenizer's arrays left out, but for the vocabulary's length)."""
    done = subprocess.run([sys.executable, "-c", READ_BACK, str(path)], env=llamacpp.converter_env(),
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SpecdrafterError(f"{str(path)!r} does not read back as GGUF ({done.stderr.strip().splitlines()[-1:]})")
    return json.loads(done.stdout)


def check_gguf(path: Path, layers: List[int] | None, config: dict) -> None:
    """The converted file reads the layers the drafter was trained on and keeps a pruned vocabulary's d2t."""
    found = read_gguf(path)
    if layers is not None and found["target_layers"] != layers:
        raise SpecdrafterError(f"llama.cpp's converter wrote target layers {found['target_layers']}, but the drafter "
                               f"was trained on {layers}: not served as trained")
    for key in (key for key in CONVERTED_FLAGS if key in config):
        written = found["fields"].get(f"{found['arch']}.{key}")
        if written != config[key]:
            raise SpecdrafterError(f"llama.cpp's converter wrote {found['arch']}.{key} = {written}, but the drafter's "
                                   f"config.json says {key}: {json.dumps(config[key])}: not served as trained")
    vocab, draft_vocab = config.get("vocab_size"), config.get("draft_vocab_size")
    if draft_vocab and vocab and draft_vocab < vocab:
        d2t = [shape for name, shape in found["tensors"].items() if name.endswith("d2t")]
        if d2t != [[draft_vocab]]:
            raise SpecdrafterError(f"llama.cpp's converter dropped the pruned draft vocabulary ({draft_vocab} of {vocab} "
                                   f"tokens; d2t in the GGUF: {d2t or 'none'})")


def serving(spec_type: str, drafts: int) -> List[str]:
    """The model card's llama-server command for draft.gguf (`drafts`: the most draft tokens per step)."""
    return ["llama.cpp (`llama-server`; the target converted with the same tree's `convert_hf_to_gguf.py`):", "",
            "```bash", f"llama-server -m TARGET.gguf -md {DRAFT_FILE} --spec-type {spec_type} "
            f"--spec-draft-n-max {drafts} -t 1", "```", "",
            "`-t 1` on a machine whose cores are shared: llama.cpp's threads spin while they wait."]
