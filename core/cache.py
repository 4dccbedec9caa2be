"""The one cache folder every downloaded or built asset lives under: `$SPECDRAFTER_CACHE`, else the user's cache
folder (`~/.cache/specdrafter` on Linux). Here, at the bottom of the layers, so that core/ (the llama.cpp build) and
data/ (the target and prompt sets) agree on it."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDRAFTER_CACHE") or platformdirs.user_cache_dir("specdrafter")).expanduser()
