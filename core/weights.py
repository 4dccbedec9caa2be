"""Weight files: safetensors read whole, memory-mapped or checked by their header alone, a model folder checked
before anything loads it, and config + weights published as one folder. The rest of the crash-safe I/O, which needs
no ML library, is core/io.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Optional

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specdrafter.core.io import (
    TRAINER_STATE,
    SpecdrafterError,
    checkpoint_problem,
    first_line,
    json_file_problem,
    publish_dir,
    temp_dir_beside,
)


def safetensors_problem(path: Path) -> Optional[str]:
    """Why `path` is not a complete safetensors file (missing, empty, truncated, corrupt header), or None. Reads
    only the header: the file's size must match what the header describes."""
    try:
        if Path(path).stat().st_size == 0:
            return "is empty"
        with safe_open(str(path), "pt"):
            return None
    except FileNotFoundError:
        return "is missing"
    except Exception as e:  # SafetensorError (not an OSError): truncated, zeroed, a corrupt header, not safetensors
        return f"is truncated or corrupt ({first_line(e)})"


def read_safetensors(path: Path) -> dict:
    """load_file, with anything wrong with the file as one SpecdrafterError naming it."""
    problem = safetensors_problem(path)
    if problem:
        raise SpecdrafterError(f"{str(path)!r} {problem}")
    return load_file(str(path))


SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


def mmap_safetensors(path: Path) -> dict:
    """The tensors of a safetensors file as zero-copy views of a private read-only memory map: pages are read when
    touched and stay in the page cache, which the OS can evict, rather than in the process's own memory — so a cache
    of hidden states larger than RAM can be trained on. Anything wrong with the file is one SpecdrafterError."""
    problem = safetensors_problem(path)
    if problem:
        raise SpecdrafterError(f"{str(path)!r} {problem}")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    data = torch.from_file(str(path), shared=False, size=Path(path).stat().st_size, dtype=torch.uint8)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        out[name] = data[start:end].view(SAFETENSORS_DTYPES[info["dtype"]]).view(info["shape"])
    return out


def check_model_folder(folder: Path, what: str) -> Path:
    """A model folder a user points at (a drafter folder, an export, a target): it must be a folder with a readable
    config.json and complete *.safetensors files, and — for a checkpoint's drafter/ — match the checksums its
    checkpoint recorded. Anything else is one SpecdrafterError naming the file and what is wrong."""
    folder = Path(folder).expanduser()
    if not folder.exists():
        raise SpecdrafterError(f"{what} {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise SpecdrafterError(f"{what} {str(folder)!r} is a file, not a folder (config.json + model.safetensors)")
    if (folder.parent / TRAINER_STATE).is_file():  # …/step-N/drafter: verified against its checkpoint's checksums
        problem = checkpoint_problem(folder.parent, only=(f"{folder.name}/",))
        if problem:
            raise SpecdrafterError(f"{what} {str(folder)!r}: its checkpoint is damaged ({problem})")
    problem = json_file_problem(folder / "config.json")
    if problem:
        raise SpecdrafterError(f"{what} {str(folder)!r}: config.json {problem}")
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("pytorch_model*.bin")):
        raise SpecdrafterError(f"{what} {str(folder)!r}: model.safetensors is missing (no weights in the folder)")
    for path in sorted(folder.rglob("*.safetensors")):
        problem = safetensors_problem(path)
        if problem:
            raise SpecdrafterError(f"{what} {str(folder)!r}: {path.relative_to(folder)} {problem}")
    return folder


def save_weights(tensors: Dict[str, torch.Tensor], path: Path) -> None:
    """A published safetensors file: metadata {"format": "pt"} (what transformers and the engines expect) and mode
    0644 (safetensors leaves 0600)."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o644)


def write_config_and_weights(module, folder: Path) -> None:
    """`module.config` (config.json) + its state dict (model.safetensors) into an existing folder."""
    module.config.save_pretrained(folder)
    save_weights({k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}, Path(folder) / "model.safetensors")


def save_config_and_weights(module, folder: Path) -> Path:
    """Publish `module.config` (config.json) + its state dict (model.safetensors) as one folder, atomically."""
    tmp = temp_dir_beside(Path(folder))
    write_config_and_weights(module, tmp)
    return publish_dir(tmp, Path(folder))
