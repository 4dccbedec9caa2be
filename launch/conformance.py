"""Conformance run: do the engines' own loaders read our exports unchanged? Not part of the test suite.

    python launch/conformance.py [--out runs/conformance] [--reinstall]

The same as `python benchmarks/conformance.py ...`: the venv, the tiny drafters, their exports and the engines'
checks are benchmarks/conformance.py's (outside the installed package).
"""

import runpy
from pathlib import Path

if __name__ == "__main__":
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "conformance.py"), run_name="__main__")
