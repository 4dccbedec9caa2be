"""--help of the commands a new user tries first: usage on stdout and exit 0, every option with its help and default.
No llama.cpp build needed."""

import subprocess
import sys

import pytest
from conftest import REPO

from specdrafter.engines.serve import main as serve_main


def test_the_main_job_prints_its_usage_for_help():
    for flag in ("--help", "-h"):
        done = subprocess.run([sys.executable, str(REPO / "launch" / "main_job.py"), flag], capture_output=True,
                              text=True, cwd=REPO, timeout=300)
        assert done.returncode == 0 and "error" not in done.stderr
        assert done.stdout.startswith("The README's main job in one command")
        assert "python launch/main_job.py [--pairing NAME] [key=value ...] [--serve]" in done.stdout
        assert "qwen2.5-coder-1.5b, the\npairing local users run" in done.stdout


def test_the_main_job_names_its_pairings_for_an_unknown_one():
    done = subprocess.run([sys.executable, str(REPO / "launch" / "main_job.py"), "--pairing", "llama-70b"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode != 0 and done.stderr.strip().splitlines() == [
        "usage: python launch/main_job.py [--pairing smollm2-135m|qwen2.5-coder-1.5b] [key=value ...] [--serve] "
        "[--help] (--pairing 'llama-70b': one of smollm2-135m, qwen2.5-coder-1.5b)"]


def test_serve_help_gives_the_port_its_help_and_default(capsys):
    with pytest.raises(SystemExit) as e:
        serve_main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--port PORT the port llama-server listens on (default: 8080)" in text
