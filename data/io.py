"""Small file helpers shared by every job: atomic writes and checksums. A reader never sees half a file."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, List

from safetensors.torch import save_file


class SpecdrafterError(Exception):
    """An error the user can fix; the CLI prints its message as one line and exits non-zero."""


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write to a temp file in the same folder, fsync, then rename over `path` (atomic on POSIX)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; published files are ordinary files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def temp_dir_beside(final: Path) -> Path:
    """A fresh temp folder next to `final`, to be filled and then renamed onto it with `publish_dir`."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp"))


def publish_dir(tmp: Path, final: Path) -> Path:
    """Rename a finished temp folder onto `final` (replacing an old one) so readers see all or nothing."""
    if final.exists():
        shutil.rmtree(final)
    os.chmod(tmp, 0o755)  # mkdtemp creates 0700
    os.replace(tmp, final)
    return final


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def remove_stale_temps(folder: Path) -> None:
    """Delete temp files/folders a killed run left behind (they are never trusted, only cleaned up)."""
    if not folder.is_dir():
        return
    for p in folder.glob(".*.tmp"):
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)


def complete_checkpoints(root: Path) -> List[Path]:
    """Checkpoint folders (root/step-NNNNNN) whose trainer_state.json — written last — exists, oldest first."""
    return sorted(p.parent for p in Path(root).glob("step-*/trainer_state.json"))


def write_config_and_weights(module, folder: Path) -> None:
    """`module.config` (config.json) + its state dict (model.safetensors) into an existing folder."""
    module.config.save_pretrained(folder)
    save_file({k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}, str(Path(folder) / "model.safetensors"))


def save_config_and_weights(module, folder: Path) -> Path:
    """Publish `module.config` (config.json) + its state dict (model.safetensors) as one folder, atomically."""
    tmp = temp_dir_beside(Path(folder))
    write_config_and_weights(module, tmp)
    return publish_dir(tmp, Path(folder))
