"""core/io.py:publish_dir, which every job publishes its folders through (checkpoints, <run>/drafter, data shards,
exports, cached assets): it replaces only a folder, never a file, and what it publishes others can read."""

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specdrafter.core.io import SpecdrafterError, publish_dir, temp_dir_beside


def filled_temp(final: Path) -> Path:
    """A temp folder beside `final` as the savers leave it: safetensors writes 0600, mkdtemp makes the folder 0700."""
    tmp = temp_dir_beside(final)
    (tmp / "sub").mkdir(mode=0o700)
    save_file({"w": torch.zeros(2)}, str(tmp / "sub" / "model.safetensors"))
    (tmp / "config.json").write_text("{}")
    return tmp


def test_a_published_folder_is_readable_by_others(tmp_path):
    final = publish_dir(filled_temp(tmp_path / "out"), tmp_path / "out")
    modes = {p.relative_to(final).as_posix(): p.stat().st_mode & 0o777 for p in [final, *final.rglob("*")]}
    assert modes == {".": 0o755, "sub": 0o755, "sub/model.safetensors": 0o644, "config.json": 0o644}


def test_an_old_folder_is_replaced_whole_and_no_temp_is_left(tmp_path):
    final = tmp_path / "out"
    publish_dir(filled_temp(final), final)
    (final / "stale.txt").write_text("from the earlier save")
    publish_dir(filled_temp(final), final)
    assert sorted(p.relative_to(final).as_posix() for p in final.rglob("*")) == [
        "config.json", "sub", "sub/model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("what", ["file", "link"])
def test_a_file_or_a_link_in_the_way_is_refused_and_kept(tmp_path, what):
    """Issue 54: a file in the way ended in NotADirectoryError from shutil.rmtree, a traceback."""
    final, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    if what == "file":
        final.write_text("mine")
    else:
        os.symlink(elsewhere, final)
    tmp = filled_temp(final)
    with pytest.raises(SpecdrafterError, match=r"'.*out' is a file, not a folder; nothing was replaced"):
        publish_dir(tmp, final)
    assert final.is_symlink() == (what == "link")
    assert (final if what == "file" else elsewhere / "keep.txt").read_text() == "mine"
    assert tmp.is_dir()  # the caller's to remove, as after any failure
