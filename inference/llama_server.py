"""llama-server, started, asked and stopped by the project (the launcher, the eval job's llama.cpp arm, the tests).

`LlamaServer(model, draft=..., spec_type=..., n_max=...)` is a context manager: entering starts the binary that
core/llamacpp.py built, waits for `/health` and raises one SpecdrafterError line if it cannot (a port in use, the
server exiting during start-up with the last line of its log, no answer within `startup_s`); leaving stops it
(SIGTERM, then SIGKILL after `STOP_S`). A server is also stopped when the interpreter exits (atexit) and when the
process gets SIGTERM or SIGHUP (a closed terminal), so Ctrl-C or a killed job leaves no llama-server behind. Where
no handler can run (SIGKILL, a crash), the kernel ends the server: on Linux it is started with the parent-death signal
SIGKILL (prctl PR_SET_PDEATHSIG), which fires when the *thread* that started it ends, so only a server started from
the main thread gets it (one started from another thread is still stopped on every other path). `complete()` sends
one /completion of token ids and returns the reply; a server that dies mid-run is `ServerDied`, a SpecdrafterError
naming its exit status and its log's last line.

Threads: ggml's worker threads spin while they wait, so on a shared machine `threads=1` (the default) and one server
at a time; two servers, or a server beside a torch job, on 2 cores distort each other's timings badly.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from http.client import HTTPException
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from specdrafter.core import llamacpp
from specdrafter.core.io import SpecdrafterError
from specdrafter.core.llamacpp import DRAFTLESS, SPEC_DEFAULT

STOP_S = 10.0
_RUNNING: Dict[int, "LlamaServer"] = {}  # pid → server, stopped at exit or on SIGTERM / SIGHUP
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # handled like Ctrl-C: the servers are stopped, then the process exits
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class ServerDied(SpecdrafterError):
    """The server exited (or stopped answering) after it had started."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class LlamaServer:
    """One llama-server process serving `model` (a target GGUF), with a drafter when `draft` is given."""

    def __init__(self, model: Path, draft: Optional[Path] = None, spec_type: Optional[str] = None,
                 n_max: Optional[int] = None, p_min: Optional[float] = None, threads: int = 1, context: int = 4096,
                 port: Optional[int] = None, parallel: int = 1, extra: Sequence[str] = (), startup_s: float = 120.0,
                 binary: Optional[Path] = None, env: Optional[Dict[str, str]] = None):
        if draft is not None and spec_type is None:
            raise SpecdrafterError("a drafter GGUF needs its --spec-type")
        if draft is None and spec_type is not None and spec_type not in DRAFTLESS:
            raise SpecdrafterError(f"--spec-type {spec_type} needs its drafter GGUF (without one llama.cpp drafts by "
                                   f"{', '.join(DRAFTLESS)})")
        self.model, self.draft, self.spec_type, self.n_max, self.p_min = Path(model), draft, spec_type, n_max, p_min
        self.threads, self.context, self.parallel, self.extra, self.startup_s = threads, context, parallel, extra, startup_s
        self.port = port
        # another llama-server build (a patched one, benchmarks/llamacpp_patches/) and variables added to its
        # environment; None: the installed build, this process's environment
        self.binary, self.env = binary, env
        self.process: Optional[subprocess.Popen] = None
        self.log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> List[str]:
        """llama-server's arguments (without the binary's path)."""
        args = ["-m", str(self.model), "--port", str(self.port), "-t", str(self.threads), "-c", str(self.context),
                "--parallel", str(self.parallel), "--no-webui"]
        if llamacpp.amx_repack_crashes():
            args.append("--no-repack")
        if self.spec_type == SPEC_DEFAULT:
            args.append("--spec-default")
        elif self.spec_type is not None:
            args += (["-md", str(self.draft)] if self.draft is not None else []) + ["--spec-type", self.spec_type]
        if self.spec_type is not None:
            if self.n_max is not None:
                args += ["--spec-draft-n-max", str(self.n_max)]
            if self.p_min is not None:
                args += ["--spec-draft-p-min", str(self.p_min)]
        return args + list(self.extra)

    # ------------------------------------------------------------------------------------------- start / stop
    def __enter__(self) -> "LlamaServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        for path in (self.model, self.draft):
            if path is not None and not Path(path).is_file():
                raise SpecdrafterError(f"{str(path)!r} does not exist (a GGUF file is needed)")
        if self.port is None:
            self.port = free_port()
        elif port_in_use(self.port):
            raise SpecdrafterError(f"port {self.port} is in use (another server?): choose another with --port")
        binary = self.binary or llamacpp.binary("llama-server")
        _stop_on_signals()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
        self.process = subprocess.Popen([str(binary), *self.command()], stdout=self.log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, preexec_fn=dies_with_parent(),
                                        env={**os.environ, **self.env} if self.env else None)
        _RUNNING[self.process.pid] = self
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_s
        while True:
            if self.process.poll() is not None:
                raise SpecdrafterError(f"llama-server exited during start-up (exit {self.process.returncode}): "
                                       f"{self.last_log_line()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (OSError, HTTPException):  # not listening yet, or 503 while the model loads
                pass
            if time.monotonic() > deadline:
                raise SpecdrafterError(f"llama-server did not answer /health within {self.startup_s:.0f} s: "
                                       f"{self.last_log_line()}")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_S; idempotent. The log file is removed."""
        process, self.process = self.process, None
        if process is not None:
            _RUNNING.pop(process.pid, None)
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=STOP_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        if self.log is not None:
            self.log.close()
            Path(self.log.name).unlink(missing_ok=True)
            self.log = None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_text(self) -> str:
        """Everything the server has written so far."""
        if self.log is None:
            return ""
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def last_log_line(self) -> str:
        """The last informative line the server wrote (its error, usually)."""
        lines = [line.strip() for line in self.log_text().splitlines() if line.strip()]
        errors = [line for line in lines if "error" in line.lower() or "failed" in line.lower()]
        return (errors or lines or ["no output"])[-1][:400]

    # ------------------------------------------------------------------------------------------------ asking
    def complete(self, prompt: Sequence[int], n_predict: int, temperature: float = 0.0, seed: int = 0,
                 n_probs: int = 0, timeout: float = 600.0, **fields) -> dict:
        """One /completion of the token ids `prompt`: the reply (`tokens`, `timings` with llama.cpp's draft
        counters, `completion_probabilities` when n_probs > 0). Every sampler but the temperature is off, so T > 0
        samples the target's own law; `fields` add or override request fields."""
        body = {"prompt": list(prompt), "n_predict": n_predict, "temperature": temperature, "seed": seed,
                "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0,
                "samplers": ["temperature"], "return_tokens": True, "cache_prompt": False, "n_probs": n_probs,
                **fields}
        return self.post("/completion", body, timeout)

    def post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        if not self.alive():
            raise self._died()
        request = urllib.request.Request(self.url + path, json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as e:
            detail = " ".join(e.read().decode(errors="replace").split())[:300]
            raise SpecdrafterError(f"llama-server refused {path} (HTTP {e.code}): {detail}") from None
        except (OSError, HTTPException, ValueError) as e:
            if not self.alive():
                raise self._died() from None
            raise ServerDied(f"llama-server stopped answering {path} ({type(e).__name__}: {e})") from None

    def _died(self) -> ServerDied:
        code = None if self.process is None else self.process.poll()
        return ServerDied(f"llama-server died (exit {code}): {self.last_log_line()}")


def _stop_all() -> None:
    for server in list(_RUNNING.values()):
        server.stop()


def _on_stop_signal(signum, frame) -> None:
    _stop_all()
    raise SystemExit(128 + signum)


def _stop_on_signals() -> None:
    """A SIGTERM or SIGHUP to this process stops its servers first (only the main thread may set a handler; one
    already set, e.g. by a job runner, or a signal ignored, e.g. under nohup, is left alone)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) == signal.SIG_DFL:
            signal.signal(signum, _on_stop_signal)


def dies_with_parent() -> Optional[Callable[[], None]]:
    """Popen's preexec_fn that has the kernel SIGKILL the child when this process ends however it ends, SIGKILL
    included (Linux). The parent-death signal fires when the thread that forked the child ends, so it is set only
    from the main thread, which lives as long as the process (None elsewhere, and off Linux)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    libc, parent = ctypes.CDLL(None, use_errno=True), os.getpid()

    def preexec() -> None:  # in the child, between fork and exec
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: no signal would come
            os._exit(1)
    return preexec


atexit.register(_stop_all)
