"""Small file helpers shared by every job: atomic writes and checksums. A reader never sees half a file."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence


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
    """Rename a finished temp folder onto `final` so readers see all or nothing. An existing `final` is replaced only
    when it is a folder, which the caller vouches is its own earlier output (export/formats.py checks a user's --out
    first); a file or a link there is refused, never deleted."""
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        raise SpecdrafterError(f"{str(final)!r} is a file, not a folder; nothing was replaced")
    make_readable(tmp)
    if not final.exists():
        os.replace(tmp, final)
        return final
    # the old folder is moved aside rather than deleted first: `final` is missing only between two renames, a failed
    # rename puts the old one back, and a process killed in between leaves a temp that remove_stale_temps cleans
    old = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".old.tmp"))
    os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        os.replace(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return final


def make_readable(folder: Path) -> None:
    """Every folder under `folder` (itself included) 0755 and every file 0644, as atomic_write_bytes writes them:
    mkdtemp creates 0700, and safetensors (so transformers' save_pretrained too) writes weights 0600, which another
    user or a container serving the folder cannot read. Links are left alone (chmod would follow them)."""
    os.chmod(folder, 0o755)
    for parent, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(parent, name)
            if not os.path.islink(path):
                os.chmod(path, 0o755 if name in dirs else 0o644)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def remove_stale_temps(folder: Path, name: str = "") -> None:
    """Delete temp files/folders a killed run left behind (they are never trusted, only cleaned up); with `name`,
    only those of that file or folder (another process may be writing the others)."""
    if not folder.is_dir():
        return
    for p in folder.glob(f".{name}*.tmp" if name else ".*.tmp"):
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)


@contextmanager
def claim(path: Path) -> Iterator[bool]:
    """An exclusive claim on one piece of work that several processes share (a data shard): yields True while this
    process holds the lock on `path`, or False at once if another process does. The lock (flock) goes when the block
    ends or the process dies, even when killed, so a crashed worker's work is free again and nothing is left to clean."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def file_checksums(folder: Path, skip: Sequence[str] = ()) -> Dict[str, str]:
    """{path relative to `folder` (POSIX): sha256} of every file under `folder`, except the relative paths in `skip`."""
    folder = Path(folder)
    names = (p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*")) if p.is_file())
    return {name: sha256_file(folder / name) for name in names if name not in skip}


def checksum_problem(folder: Path, files: Dict[str, str]) -> Optional[str]:
    """What is wrong with the first file of `files` ({relative path: sha256}) that is missing or altered; None if
    every one matches. The one check behind the data job's shards and the training checkpoints."""
    for name, digest in files.items():
        path = Path(folder) / name
        if not path.is_file():
            return f"{name} is missing"
        if sha256_file(path) != digest:
            return f"{name} does not match its checksum"
    return None


def json_digest(obj: Any) -> str:
    """sha256 of a JSON value, independent of key order and layout (a state file's checksum of itself). Taken of the
    value as read back from JSON (int keys become strings), so the writer and a later reader agree."""
    canonical = json.loads(json.dumps(obj, ensure_ascii=False))
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# --------------------------------------------------------------------------------- files a user points at
def json_file_problem(path: Path) -> Optional[str]:
    """Why `path` is not a readable JSON object (missing, empty, not UTF-8, not JSON, another JSON value), or None."""
    try:
        raw = Path(path).read_bytes()
        obj = json.loads(raw.decode())
    except FileNotFoundError:
        return "is missing"
    except OSError as e:
        return f"is unreadable ({first_line(e)})"
    except UnicodeDecodeError as e:
        return f"is not UTF-8 text (byte {e.start})"
    except ValueError as e:
        return "is empty" if not raw.strip() else f"is not valid JSON ({first_line(e)})"
    return None if isinstance(obj, dict) else f"holds a JSON {type(obj).__name__}, not an object"


# ------------------------------------------------------------------------------------------- checkpoints
TRAINER_STATE = "trainer_state.json"
CHECKSUM_KEYS = ("files", "state_sha256")  # what trainer_state.json records about the checkpoint's integrity


def complete_checkpoints(root: Path) -> List[Path]:
    """Checkpoint folders (root/step-NNNNNN) whose trainer_state.json — written last — exists, oldest first (folders
    moved aside as damaged, step-NNNNNN.damaged, are not checkpoints)."""
    found = (p.parent for p in Path(root).glob(f"step-*/{TRAINER_STATE}"))
    return sorted(p for p in found if re.fullmatch(r"step-\d+", p.name))


def write_checkpoint_state(folder: Path, state: dict) -> Path:
    """trainer_state.json, the last file of a checkpoint: `state` + the sha256 of every other file of the checkpoint
    (files) + the sha256 of the state itself (state_sha256)."""
    state = {**state, "files": file_checksums(folder, skip=(TRAINER_STATE,))}
    return atomic_write_json(Path(folder) / TRAINER_STATE, {**state, "state_sha256": json_digest(state)})


def checkpoint_problem(folder: Path, only: Sequence[str] = ("",)) -> Optional[str]:
    """Why a complete checkpoint cannot be trusted, or None. Verifies trainer_state.json against itself and the
    files whose relative paths start with one of `only` (default: all). A trainer_state.json without checksums (no
    files / state_sha256: an export's, whose folder is not the checkpoint's) is trusted as it is."""
    try:
        state = json.loads((Path(folder) / TRAINER_STATE).read_bytes().decode())
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return f"{TRAINER_STATE} is unreadable ({first_line(e)})"
    if not isinstance(state, dict):
        return f"{TRAINER_STATE} is not a JSON object"
    if not any(k in state for k in CHECKSUM_KEYS):
        return None
    digest = state.pop("state_sha256", None)
    if digest != json_digest(state) or not isinstance(state.get("files"), dict):
        return f"{TRAINER_STATE} does not match its checksum"
    return checksum_problem(folder, {k: v for k, v in state["files"].items() if k.startswith(tuple(only))})


def read_checkpoint_state(folder: Path, only: Sequence[str] = ("",)) -> dict:
    """trainer_state.json of a checkpoint someone points at, verified (`checkpoint_problem`), without its checksums.
    A damaged checkpoint is one SpecdrafterError naming the file."""
    problem = checkpoint_problem(folder, only)
    if problem:
        raise SpecdrafterError(f"checkpoint {str(folder)!r} is damaged: {problem}")
    state = json.loads((Path(folder) / TRAINER_STATE).read_text())
    return {k: v for k, v in state.items() if k not in CHECKSUM_KEYS}


def move_aside(path: Path, suffix: str = ".damaged") -> Path:
    """Rename a file or folder to <name><suffix> (then <name><suffix>-2, ...) beside it; returns the new path."""
    path = Path(path)
    dest, n = path.with_name(path.name + suffix), 1
    while dest.exists():
        n += 1
        dest = path.with_name(f"{path.name}{suffix}-{n}")
    os.replace(path, dest)
    return dest


def discard_damaged_checkpoints(root: Path) -> List[str]:
    """Verify the newest complete checkpoint under `root`; while it is damaged, move it aside (<name>.damaged) and
    verify the one before. Returns one line per checkpoint moved aside, naming the checkpoint resumed from instead."""
    lines, found = [], complete_checkpoints(root)
    while found and (problem := checkpoint_problem(found[-1])) is not None:
        folder = found.pop()
        dest = move_aside(folder)
        instead = f"resuming from {found[-1].name}" if found else "no complete checkpoint left: training starts afresh"
        lines.append(f"checkpoint {folder} is damaged ({problem}): moved aside to {dest.name}; {instead}")
    return lines
